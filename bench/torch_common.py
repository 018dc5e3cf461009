"""What the PyTorch reference benches share: the SmolLM2-135M configuration, the f32 matmul
ceiling and the peak of live tensor bytes during one step. Torch is passed in or imported where
used, so that a bench can measure its memory before torch loads.
"""
import json
import math
import os
import time

# HuggingFaceTB/SmolLM2-135M's config.json, the fields a LlamaConfig needs.
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
    max_position_embeddings=2048,
)


def matmul_ceiling(torch):
    """FLOP/s of the best of ten f32 1024^3 matmuls (after one warm-up): the machine's ceiling."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = math.inf
    for i in range(11):
        s = time.perf_counter()
        a @ b
        if i:
            best = min(best, time.perf_counter() - s)
    return 2 * 1024**3 / best


def peak_step_bytes(step):
    """Highest sum of live tensor bytes during `step()`, from the profiler's memory timeline
    (every tensor the step touches: weights, gradients, optimiser state, activations)."""
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(d, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.load(open(path))
    return max(sum(s) for s in sizes)
