#include "index/retriever.hpp"

#include "core/error.hpp"
#include "core/vec_math.hpp"
#include "index/exact_retriever.hpp"
#include "index/page_retriever.hpp"
#include "index/pq_retriever.hpp"

namespace kvret {

std::unique_ptr<Retriever> Retriever::clone() const {
  throw Error(KVRET_ERR_UNSUPPORTED, "this index kind cannot be copied, so its sequences cannot be forked");
}

std::unique_ptr<Retriever> make_retriever(const kvret_config& c, int layer) {
  switch (c.index_kind) {
    case KVRET_INDEX_EXACT:
      return std::make_unique<ExactRetriever>();
    case KVRET_INDEX_STREAMING:
      return std::make_unique<StreamingRetriever>();
    case KVRET_INDEX_PQ: {
      PqRetriever::Params p;
      p.m = c.pq_m;
      p.bits = c.pq_bits;
      p.iters = c.pq_iters;
      p.tol = c.pq_tol;
      p.train_sample = c.pq_train_sample;
      p.exact_fraction = c.pq_exact_fraction;
      uint64_t state = c.seed ^ (static_cast<uint64_t>(layer) << 32);
      p.seed = splitmix64(state);
      return std::make_unique<PqRetriever>(c.n_kv_heads, c.head_dim, p);
    }
    case KVRET_INDEX_PAGE:
      return std::make_unique<PageRetriever>(c.n_kv_heads, c.head_dim, c.page_size);
    default:
      throw Error(KVRET_ERR_UNSUPPORTED, "index kind " + std::to_string(c.index_kind) + " is not implemented");
  }
}

}  // namespace kvret
