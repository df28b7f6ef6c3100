"""The attention ops' one-launch cache writes (reference/cache_triton.py) against the
PyTorch reference of the same writes (``index_copy_`` and ``attention_reference.compress_kv``):
the case shared by the CPU test (under Triton's interpreter, in a child process) and
the GPU test."""
import torch

from conftest import small_config
from replay_backend.batch import RequestChunk as R
from replay_backend.batch import build_step_batch
from replay_backend.kv_cache import CacheLayout
from replay_backend.reference.kv_caches import KVCaches
from replay_backend.reference import cache_triton
from replay_backend.reference.attention_ops import COMP_FIELD, COMP_SLOTS
from replay_backend.reference.attention_reference import compress_kv


def check_against_reference(device: str) -> None:
    """Two steps whose requests continue, so ratio-2 pairs complete both inside one
    step and across steps, in fp32 and bf16; any difference beyond rounding fails."""
    cfg = small_config()  # layer 1: a ratio-2 source, layer 3: the ratio-1 source
    d = cfg.head_dim
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    for dtype in (torch.float32, torch.bfloat16):
        layout = CacheLayout(64, 3)
        got, want = KVCaches(cfg, layout, device, dtype), KVCaches(cfg, layout, device, dtype)
        norm_w = (torch.rand(d, generator=gen) + 0.5).to(dtype).to(device)
        steps = (([R("a", 7, 7), R("b", 6, 9)], [0, 2]),  # b's rows start at odd position 3
                 ([R("a", 3, 10), R("b", 1, 10), R("c", 64, 64)], [0, 2, 1]))  # 7 pairs with step 1's 6
        for reqs, blocks in steps:
            batch = build_step_batch(reqs, [[1] * r.query_len for r in reqs], blocks, layout, cfg.window, device,
                                     view_fields=COMP_FIELD)
            view, t = batch.view, batch.num_tokens
            kv = rand(t + 2, d, dtype=dtype)  # padded rows past t are not written
            kv_c = rand(t + 2, 2 * d, dtype=dtype)[:, :d]  # rows of stride 2 * d
            gate = rand(t + 2, d, dtype=dtype)
            for layer, comp in ((0, None), (1, (kv_c, gate, norm_w)), (3, (kv_c, None, norm_w))):
                want.swa[layer].index_copy_(0, view.slot_mapping, kv[:t])
                if comp is not None:
                    compress_kv(layer, *comp, view.num_tokens, view.slot_mapping, view.derived[COMP_SLOTS].view(-1),
                              want, cfg.rms_eps)
                    comp = (*comp, got.raw.get(layer), got.glob[layer], view.derived[COMP_SLOTS].view(-1), cfg.rms_eps)
                cache_triton.write(kv, got.swa[layer], view.slot_mapping, t, comp)
        # fp32: the same math up to the order of one row's sum; bf16: a rounding apart
        tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else {}
        for layer in range(cfg.num_layers):
            torch.testing.assert_close(got.swa[layer], want.swa[layer], atol=0, rtol=0)
        torch.testing.assert_close(got.raw[1], want.raw[1], atol=0, rtol=0)
        for src, glob in got.glob.items():
            # The pad slot is the reference's throw-away target; the kernel skips it.
            torch.testing.assert_close(glob[:-1], want.glob[src][:-1], **tol)
            assert not glob[-1].any(), "the kernel wrote the pad slot"
            assert glob[:-1].any(), "nothing was compared"
