"""A tiny llama GGUF for the tests: random but seeded weights, a SentencePiece-style vocab.

About 0.6 MB, written in a fraction of a second with the ``gguf`` package (the test
extra). llama.cpp's ``llama-server`` loads it like any llama, is healthy within tens of
milliseconds and, decoding greedily, writes the same text every run: the output rows of the
control and byte tokens are zero, so end-of-sequence never wins (generation runs to
``max_tokens``) and no lone UTF-8 byte is ever emitted; what comes out is whole pieces of
lower-case ASCII.
"""

from __future__ import annotations

import string
from pathlib import Path

SEED = 20251202
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 128
N_LAYER = 2
CONTEXT_LENGTH = 256

CONTROL_TOKENS = ["<unk>", "<s>", "</s>"]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Whole words after the single characters: the SentencePiece merges that llama.cpp's SPM
# tokenizer finds (a higher score merges first).
WORDS = [
    "the",
    "model",
    "serves",
    "tokens",
    "on",
    "every",
    "node",
    "and",
    "each",
    "agent",
    "starts",
    "one",
    "server",
    "while",
    "control",
    "plane",
    "never",
    "dials",
    "it",
    "so",
    "a",
    "deployment",
    "runs",
    "where",
    "its",
    "weights",
    "are",
    "present",
    "llama",
    "cpp",
    "reads",
    "gguf",
    "files",
    "from",
    "disk",
    "then",
    "answers",
    "over",
    "loopback",
    "only",
    "with",
    "greedy",
    "text",
    "that",
    "stays",
    "same",
    "between",
    "because",
    "seed",
    "is",
    "fixed",
    "here",
    "for",
    "tests",
]
# A template llama-server's Jinja engine renders: the messages' contents, one per line.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '' }}{% endif %}"
)


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, their scores and their types (llama.cpp's 1 normal, 2 unknown, 3 control, 6 byte)."""
    import gguf

    normal = int(gguf.TokenType.NORMAL)
    tokens = list(CONTROL_TOKENS)
    types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(int(gguf.TokenType.BYTE))
        scores.append(0.0)
    pieces = ["\u2581"] + list(string.ascii_lowercase + string.digits + ".,!?'-")
    pieces += ["\u2581" + letter for letter in string.ascii_lowercase]
    pieces = list(dict.fromkeys(pieces + ["\u2581" + word for word in WORDS]))
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(normal)
        # longer pieces first, so whole words win over their letters
        scores.append(float(len(piece)) - rank / 1000.0)
    return tokens, scores, types


def write_tiny_gguf(
    path: Path | str,
    *,
    n_embd: int = N_EMBD,
    n_layer: int = N_LAYER,
    n_ff: int = N_FF,
    n_head: int = N_HEAD,
    n_head_kv: int = N_HEAD_KV,
) -> Path:
    """Write the tiny llama to ``path`` (overwritten) and return it; the same bytes every call.
    Larger dimensions give a larger model of the same kind (bench/split.py)."""
    import gguf
    import numpy as np

    path = Path(path)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    rng = np.random.default_rng(SEED)

    def weights(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    embedding = weights(n_vocab, n_embd, scale=np.sqrt(n_embd))
    output = weights(n_vocab, n_embd, scale=4.0)
    # the control and byte tokens never win a greedy pick: their logit is always 0 while
    # the best of the few hundred others is well above it
    for token_id, kind in enumerate(types):
        if kind != int(gguf.TokenType.NORMAL):
            output[token_id] = 0.0

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("modelforge-tiny-llama")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", embedding)
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(n_embd_kv, n_embd))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(n_embd_kv, n_embd))
        writer.add_tensor(f"{prefix}.attn_output.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
