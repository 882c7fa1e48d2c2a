"""Capture real keys, values and queries of SmolLM2-135M for the kernel tests: ``python -m tools.capture_kv``.

Writes ``tools.kernel_data.REAL_KV`` (under 1 MiB): for a few layers, post-RoPE keys and values [L, Hkv, T, D] and
the queries of the last QUERIES positions [L, Hq, QUERIES, D], all float16, from one forward pass over a fixed
English text.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pipeline.models import load_model
from tools.kernel_data import REAL_KV

LAYERS = (1, 15, 29)
TOKENS = 256
QUERIES = 64
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one hundred and "
    "twelve steps as his father had taught him. At the top he trimmed the wick, polished the great lens and "
    "wrote the weather in a leather logbook: wind from the north-west, swell rising, a fishing boat named "
    "Marguerite returning late. Ships passing the headland relied on the beam to find the channel between "
    "the reef and the sandbanks, and in forty years the light had never failed. When the harbour board "
    "announced that an automatic lamp would replace him, the keeper made a list of everything the machine "
    "would not notice: the gulls that nested under the gallery, the smell of rain an hour before it came, "
    "the way the sea turned green before a storm. He sent the list to the board with his resignation, and "
    "the secretary, who had grown up in the village, pinned it to the wall of her office. Years later, "
    "visitors to the museum in the old keeper's cottage could still read it in a glass case beside the lens. "
    "The museum's guide liked to finish the tour there. She would point out the spelling mistakes, the "
    "coffee ring in one corner and the last line, written in a steadier hand than the rest: a light is only "
    "as good as the person who worries about it. Most visitors laughed; a few, usually the ones who had "
    "worked at sea, stood in front of the case a little longer than the others and said nothing at all. "
    "On stormy nights the automatic lamp still turned above the cottage, faithful and indifferent."
)


def capture(path: Path = REAL_KV) -> None:
    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in LAYERS:
            seen[module.layer_idx] = (query[0], key[0], value[0])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kernels_capture", recording_attention)
    model.set_attn_implementation("kernels_capture")
    ids = tokenizer(TEXT, return_tensors="pt").input_ids[:, :TOKENS]
    if ids.shape[1] < TOKENS:
        raise RuntimeError(f"the capture text has {ids.shape[1]} tokens, fewer than {TOKENS}")
    with torch.no_grad():
        model(ids)
    q, k, v = (torch.stack([seen[layer][i] for layer in LAYERS]).half() for i in range(3))
    q = q[:, :, -QUERIES:].contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"layers": LAYERS, "queries": q, "keys": k, "values": v}, path)
    print(f"wrote {path}: queries {tuple(q.shape)}, keys/values {tuple(k.shape)}, {path.stat().st_size} bytes")


if __name__ == "__main__":
    capture()
