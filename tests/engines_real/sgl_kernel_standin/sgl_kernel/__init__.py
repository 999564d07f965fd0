"""Stand-in for `sgl_kernel` (PyPI `sglang-kernel`), which has no CPU build on PyPI.

SGLang 0.5.23's CPU engine (`--device cpu --attention-backend torch_native`, a Llama
model, no speculative decoding) imports exactly these eight names when it starts, from
`sglang/kernels/ops/kvcache/cache_move.py`, `sglang/srt/mem_cache/allocation.py` and
`sglang/kernels/ops/speculative/{eagle,cache_locs,spec_tree}.py`, and calls none of them
while it starts, generates, pauses and loads weights (recorded with a stand-in that
logged every import and call). Each one raises if called, so a code path that needs a
real kernel fails loudly instead of computing something wrong. Importing any other name
fails as it would without the package.
"""

from __future__ import annotations

from typing import Any, NoReturn


def _missing(name: str) -> Any:
    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: weightsync's test stand-in has no kernels "
            "(sglang-kernel has no CPU build on PyPI)"
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


# KV cache moves (mem_cache) and speculative-decoding helpers: imported, never called here.
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")
assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")
