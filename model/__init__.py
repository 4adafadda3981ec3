"""A faithful DeepSeek-V4.1-Flash in PyTorch: config and presets, modules, packed KV layouts, the serving split.

Imports only torch, numpy, safetensors, tqdm, tokenizers and the standard library (DESIGN §2). See docs/model.md.
"""

from model.checkpoint import checkpoint_fingerprint, load_checkpoint, load_weights, save_checkpoint
from model.config import PRESETS, ModelArgs, preset
from model.decode import DecodeBatch, ReadBack, SequenceExport, VerifyResult, read_back
from model.dspark import Draft, draft_logits
from model.kv import LAYOUT_VERSION, EncoderState, GlobalKVBlock, PackedEntries, global_kv_bytes_per_token
from model.sampling import SamplingParams, sample, speculative_accept
from model.serving import Past, PrefillOutput, PrefillRun, bounded_replay, encode_prefill
from model.transformer import Transformer
from model.weights import build_model, init_weights, model_fingerprint

__all__ = [
    "LAYOUT_VERSION",
    "PRESETS",
    "DecodeBatch",
    "Draft",
    "EncoderState",
    "GlobalKVBlock",
    "ModelArgs",
    "PackedEntries",
    "Past",
    "PrefillOutput",
    "PrefillRun",
    "ReadBack",
    "SamplingParams",
    "SequenceExport",
    "Transformer",
    "VerifyResult",
    "bounded_replay",
    "build_model",
    "checkpoint_fingerprint",
    "draft_logits",
    "encode_prefill",
    "global_kv_bytes_per_token",
    "init_weights",
    "load_checkpoint",
    "load_weights",
    "model_fingerprint",
    "preset",
    "read_back",
    "sample",
    "save_checkpoint",
    "speculative_accept",
]
