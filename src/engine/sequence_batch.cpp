// The calls of a batch of sequences of one context: kvret_select_batch's and kvret_fetch_batch_async's work after
// the C layer has checked the handles (and, for a select, each sequence's arguments).
#include <memory>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "engine/context.hpp"
#include "engine/sequence.hpp"

namespace kvret {

void Sequence::select_batch(Context& ctx, Sequence* const* seqs, int32_t n, int32_t layer, const TensorView& q,
                            int32_t budget, const TensorView& out, int32_t* out_counts) {
  const auto count = static_cast<size_t>(n);
  std::vector<PreparedSelect> prepared(count);
  // selected on the backend's device (count in the job); not under check_finite, whose check of every q must come
  // before any sequence's positions are written
  std::vector<char> on_device(count, 0);
  if (ctx.config().check_finite == 0) {
    // the device's selects in one call to the backend, which fuses those it can
    std::vector<DeviceSelectPlan> plans(count);
    std::vector<const DeviceSelectJob*> jobs;
    std::vector<size_t> owner;
    for (size_t i = 0; i < count; ++i) {
      const auto row = static_cast<int64_t>(i);
      if (seqs[i]->prepare_device_select(layer, q.slice(row), budget, out.slice(row), nullptr, plans[i])) {
        jobs.push_back(&plans[i].job);
        owner.push_back(i);
      }
    }
    if (!jobs.empty()) {
      const std::unique_ptr<bool[]> done(new bool[jobs.size()]());
      ctx.backend().select_batch_on_device(jobs.data(), jobs.size(), done.get(), nullptr);
      ctx.backend().synchronize(nullptr);  // the outputs are written when the call returns
      for (size_t j = 0; j < jobs.size(); ++j)
        if (done[j]) {
          seqs[owner[j]]->finish_device_select(plans[owner[j]]);
          prepared[owner[j]].job.count = plans[owner[j]].selected;
          on_device[owner[j]] = 1;
        }
    }
  }
  // the others prepared, then one call into the index kind for all of them
  for (size_t i = 0; i < count; ++i)
    if (!on_device[i]) {
      const auto row = static_cast<int64_t>(i);
      seqs[i]->prepare_select(layer, q.slice(row), budget, out.slice(row), nullptr, prepared[i]);
    }
  std::vector<SelectJob> jobs;
  std::vector<size_t> owner;
  for (size_t i = 0; i < count; ++i)
    if (prepared[i].job.retriever != nullptr) {
      jobs.push_back(prepared[i].job);
      owner.push_back(i);
    }
  if (!jobs.empty()) ctx.kind().select_batch(jobs.data(), jobs.size(), nullptr);
  for (size_t j = 0; j < jobs.size(); ++j) prepared[owner[j]].job.count = jobs[j].count;
  for (size_t i = 0; i < count; ++i)
    if (!on_device[i]) seqs[i]->finish_select(prepared[i]);
  for (size_t i = 0; i < count; ++i) out_counts[i] = static_cast<int32_t>(prepared[i].job.count);
}

void Sequence::fetch_batch(Context& ctx, Sequence* const* seqs, int32_t n, int32_t layer, const kvret_tensor* positions,
                           const int32_t* counts, const kvret_working_set* outs, int64_t* out_rows,
                           kvret_stream stream) {
  const kvret_config& c = ctx.config();
  const auto entry = [](const char* what, int32_t i) { return std::string(what) + "[" + std::to_string(i) + "]"; };
  // every argument of every sequence is checked before anything is written
  require(layer >= 0 && layer < c.n_layers, KVRET_ERR_OUT_OF_RANGE,
          layer_name(layer) + " is out of range: the model has " + std::to_string(c.n_layers) + " layers");
  bool any_selected = false;
  for (int32_t i = 0; i < n; ++i) any_selected = any_selected || counts[i] > 0;
  TensorView pv;
  std::vector<std::byte> positions_copy;
  if (any_selected) {  // as kvret_fetch_async, positions is read only when something was selected
    pv = ctx.view(positions, "positions", {DType::I32}, {3});
    pv.expect_dim(0, n, "batch");
    pv = ctx.backend().host_readable(pv, positions_copy);  // one copy for the batch
  }
  // A gather without row sources runs on the device, and the backend checks there that its code reaches each
  // working set (the CUDA backend's pageable-memory check): that check is made here, for every entry, before any
  // entry is gathered. (With row sources the backend gathers through host copies, which reach any memory.)
  const auto sources = ctx.row_sources();
  const bool any_sources = sources && !sources->empty();
  const bool reuse = c.index_kind == KVRET_INDEX_CLUSTER && c.cluster_reuse_steps > 0;
  std::vector<PreparedFetch> prepared(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const FetchNames names{entry("positions", i), entry("outs", i) + ".k", entry("outs", i) + ".v",
                           entry("outs", i) + ".positions", entry("counts", i)};
    PreparedFetch& p = prepared[static_cast<size_t>(i)];
    seqs[i]->check_fetch(layer, counts[i], &outs[i], names, p);
    if (counts[i] > 0) {
      TensorView row = pv.slice(i);
      row.rename(names.positions);
      seqs[i]->check_fetch_positions(row, names, p);
    }
    if (!any_sources && !(reuse && counts[i] > 0))
      for (const TensorView* t : {&p.ws.k, &p.ws.v, &p.ws.positions}) ctx.backend().check_kernel_access(*t);
  }
  // the row-source chains, one gather for the batch, then the stats
  int32_t begun = 0;
  try {
    for (; begun < n; ++begun) seqs[begun]->begin_fetch(prepared[static_cast<size_t>(begun)]);
    std::vector<GatherJob> jobs(static_cast<size_t>(n));
    for (size_t i = 0; i < jobs.size(); ++i) jobs[i] = prepared[i].job;
    ctx.backend().gather_batch(jobs.data(), jobs.size(), ctx.threads(), stream);
    for (size_t i = 0; i < jobs.size(); ++i) prepared[i].job = jobs[i];
  } catch (...) {
    for (int32_t i = 0; i < begun; ++i) seqs[i]->abort_fetch(prepared[static_cast<size_t>(i)]);
    throw;
  }
  for (int32_t i = 0; i < n; ++i) {
    seqs[i]->finish_fetch(prepared[static_cast<size_t>(i)]);
    out_rows[i] = prepared[static_cast<size_t>(i)].rows;
  }
}

}  // namespace kvret
