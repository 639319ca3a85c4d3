"""The register report: Parallax and gate-scan kernels compiled for sm_90 on the CPU, as the ops launch them."""
import os

import pytest
import triton

from regattn.bench import registers
from regattn.ops.gatedfwa.gate import CHUNK_TILES_LARGE
from regattn.ops.parallax.tiles import TILES

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


compiles = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not os.path.exists(CUOBJDUMP),
                              reason="compiles for sm_90: needs Triton's NVIDIA tools and TRITON_INTERPRET unset")


@compiles
def test_decode_kernel_resource_usage():
    kernel, args, kwargs = registers.parallax_launch("decode", 32, B=1, T=256, HQ=4, H=2)
    assert registers.launch_settings(kwargs) == dict(BLOCK_M=16, TMA=False, **TILES[32]["decode"])
    usage = registers.resource_usage(registers.compile_launch(kernel, args, kwargs))
    assert 0 < usage["REG"] <= 255 and usage["STACK"] >= 0 and usage["SHARED"] > 0 and usage["SERIAL"] in (0, 1)


@compiles
def test_command_prints_the_table_entry(capsys):
    assert registers.main(["parallax", "--head-dims", "32", "--kinds", "decode"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["head_dim", "kind"] and len(lines) == 2
    assert lines[1].split()[:7] == ["32", "decode", "16", "128", "0", "4", "3"] and lines[1].split()[13] == "*"


def test_causal_is_refused_for_other_kernels_than_the_scan(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        registers.main(["lla", "--causal"])
    assert "--causal: scan only" in capsys.readouterr().err


@compiles
@pytest.mark.parametrize("gated", [True, False])
def test_softmax_kernel_launch_takes_the_tiles_given(gated):
    """GatedFWA's dQ kernel (and the ungated one) as the op launches it, with tiles in place of the table's."""
    config = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3)
    kernel, args, kwargs = registers.attention_launch("bwd_q", 64, config, gated=gated, T=256, H=2, window=64)
    assert kernel.__name__ == "_bwd_q_kernel" and kwargs["GATED"] is gated and kwargs["WINDOW"] == 64
    assert registers.launch_settings(kwargs) == config
    usage = registers.resource_usage(registers.compile_launch(kernel, args, kwargs))
    assert 0 < usage["REG"] <= 255 and usage["SHARED"] > 0


@compiles
def test_chunked_gate_scan_does_not_spill():
    """The chunked gate scan, forward and backward, at 64 heads (its widest block) and at 3 (a masked block)."""
    rows = list(registers.gate_rows(shapes=[(1, 65536, 64), (1, 8192, 3)]))
    assert sorted({r["kernel"] for r in rows}) == ["gate_chunked", "gate_chunked_bwd"] and len(rows) == 4
    for r in rows:
        assert r["STACK"] == 0 and r["LOCAL"] == 0 and 0 < r["REG"] <= 128, r


@compiles
def test_chunked_gate_scan_candidates(monkeypatch):
    """--candidates: the chunked scan also with each tile of CHUNK_TILES, num_warps as the tile says."""
    from regattn.bench.suites import gatedfwa
    monkeypatch.setattr(gatedfwa, "CHUNK_TILES", [(8192, 16, 16)])
    rows = list(registers.gate_rows(candidates=True, shapes=[(1, 65536, 64)]))
    table = [(size // heads, heads, warps, True) for size, heads, warps in CHUNK_TILES_LARGE.values()]  # 2^22 elements
    assert [(r["BLOCK_T"], r["BLOCK_H"], r["num_warps"], r["table"]) for r in rows] == table + [
        (512, 16, 16, False), (512, 16, 16, False)]
    assert all(r["STACK"] == 0 for r in rows), rows


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.128 R4, [R2] ;
        /*0020*/                   FFMA R8, R4, R5, R8 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   LDS R4, [R2] ;
        /*0050*/                   FFMA R8, R4, R5, R8 ;
        /*0060*/                   MUFU.EX2 R9, R9 ;
        /*0070*/                   STL [R1], R9 ;
        /*0080*/               @P1 BRA 0x40 ;
        /*0090*/                   BRA 0x10 ;
        /*00a0*/                   BRA 0xa0;
"""


def test_inner_loop_is_the_longest_loop_holding_no_other():
    # loops [0x10, 0x30] and [0x40, 0x80] hold none; [0x10, 0x90] holds both; 0xa0 branches to itself
    mix = registers.inner_loop(SASS)
    assert mix == {"loop": 5, "FFMA": 1, "MUFU": 1, "LDS": 1, "LDL": 0, "STL": 1, "MMA": 0, "FFMA%": 20, "FFMA/w": 1.0}
    assert registers.inner_loop("        /*0000*/                   EXIT ;") == {}


NESTED = """
        /*0000*/                   LDS R4, [R2] ;
        /*0010*/                   FFMA R8, R4, R5, R8 ;
        /*0020*/              @!P0 BRA 0x0 ;
        /*0030*/              @!P1 BRA 0x0 ;
        /*0040*/                   FFMA R8, R4, R5, R8 ;
        /*0050*/                   FFMA R8, R4, R5, R8 ;
        /*0060*/                   FFMA R8, R4, R5, R8 ;
        /*0070*/                   FFMA R8, R4, R5, R8 ;
        /*0080*/              @!P2 BRA 0x40 ;
"""


def test_inner_loop_nested_prefers_a_loop_inside_another():
    # [0x0, 0x20] sits inside [0x0, 0x30] (a solver's key loop in its iterations); [0x40, 0x80] is longer, alone
    assert registers.inner_loop(NESTED)["loop"] == 5
    assert registers.inner_loop(NESTED, nested=True)["loop"] == 3
    assert registers.inner_loop(SASS, nested=True) == registers.inner_loop(SASS)  # both innermost loops nested


@compiles
@pytest.mark.parametrize("kind", ["ieee", "tf32x3", "fp16x3", "fp16"])
def test_scan_forward_loop_uses_the_fma_pipe_only_in_strict_fp32(kind):
    config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2)
    kernel, args, kwargs = registers.scan_launch(kind, config, T=256, H=2)
    assert registers.launch_settings(kwargs) == dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    mix = registers.inner_loop(registers.cuobjdump(registers.compile_launch(kernel, args, kwargs), "-sass"))
    assert mix["MUFU"] >= 32 * 32 // 128  # an exp2 a score at least
    if kind == "ieee":  # fp32 arithmetic throughout: every product of the dots is an FFMA
        assert mix["MMA"] == 0 and mix["FFMA"] >= 2 * 32 * 32 * 64 // 128
    else:
        assert mix["MMA"] > 0


@compiles
@pytest.mark.parametrize("masked", [False, True], ids=["whole", "masked"])
def test_causal_strict_fp32_scan_keeps_spills_out_of_its_key_loops(masked):
    """The causal fold runs its whole key tiles in one launch (a loop over its two query tiles around the key loop,
    whose chunks combine inside it) and the masked ones on either side of them in another (one key loop)."""
    config = triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=2, num_stages=2)
    kernel, args, kwargs = registers.scan_launch("ieee", config, T=256, H=2, causal=True, masked=masked)
    assert kwargs["CAUSAL"] is True and kwargs["PART"] == (2 if masked else 1)
    sass = registers.cuobjdump(registers.compile_launch(kernel, args, kwargs), "-sass")
    loops = [addr for addr, op, arg in registers.SASS_LINE.findall(sass)
             if op == "BRA" and arg and int(arg.split()[-1], 16) < int(addr, 16)]
    assert len(loops) == (1 if masked else 2)
    mix = registers.inner_loop(sass)
    assert mix["LDL"] == mix["STL"] == 0 and mix["FFMA"] >= 2 * 32 * 32 * 64 // 64


@compiles
@pytest.mark.parametrize("tma", [False, True], ids=["atomics", "tma"])
def test_scan_backward_fused_kernel_compiles_without_spills(monkeypatch, tma):
    """The scan's fp16 backward with dq added in the dK/dV pass, one launch, through pointers and atomics or
    through descriptors and the tensor-memory reduction (``TMA_REDUCE``: on a GPU target, not in the
    interpreter); in two passes without it."""
    from regattn.ops._common import attention_tiles
    from regattn.ops.scan.kernels import BWD_CONFIGS, FUSED_CONFIGS
    monkeypatch.setattr(attention_tiles, "TMA_WORK", 0)  # the descriptors at this small shape too
    config = next(c for c in FUSED_CONFIGS if c.kwargs["TMA"] is tma)
    [(kernel, args, kwargs)] = registers.scan_backward_launches(config, True, T=256, H=2)
    assert kwargs["FUSED"] and kwargs["TMA"] is tma and kwargs["TMA_REDUCE"] is tma and kwargs["HAS_DESC"]
    usage = registers.launch_usage(kernel, args, kwargs, loop=True)
    assert usage["STACK"] == 0 and usage["MMA"] > 0, usage
    passes = registers.scan_backward_launches(BWD_CONFIGS["half"][0], False, T=256, H=2)
    assert [k.__name__ for k, _, _ in passes] == ["_bwd_dkdv_kernel", "_bwd_dq_kernel"]


def fp64_launches():
    """Launches of kernels with float arguments, captured on the meta device: LLA's forward (CG, 2 x 2 and
    1 x 1 solves) and backward (CG, 1 x 1 solves with dq by atomics and deterministic), and the gate scan forward
    and backward."""
    from unittest import mock

    import torch

    from regattn.ops.gatedfwa import gate
    from regattn.ops.lla import backward, forward
    q = torch.empty(1, 256, 2, 64, device="meta", dtype=torch.bfloat16)
    rows = torch.empty(1, 2, 256, device="meta")
    with registers.captured_launches() as launches, mock.patch.object(forward, "AUTOTUNE", False), \
            mock.patch.object(backward, "AUTOTUNE", False):
        for blocks in (None, 32, 64):
            forward.lla_forward(q, q, q, 0.5, scale=0.125, window=None, blocks=blocks, cg_iters=8, cg_tol=1e-6)
        for bd, deterministic in ((0, False), (1, False), (1, True)):
            with mock.patch.object(torch, "are_deterministic_algorithms_enabled", lambda d=deterministic: d):
                backward.lla_backward(q, q, q, q, 0.5, q.float(), rows, rows, rows.int(), rows,
                                      q.float().transpose(1, 2), scale=0.125, window=None, cg_iters=8,
                                      cg_tol=1e-6, lam_grad=False, bd=bd)
        h = torch.empty(2, 1024, 16, device="meta")
        gate.gate_forward(h, h, 1e-6)
        gate.gate_backward(h, h, h, 1e-6)
    return launches


@compiles
def test_float_arguments_may_come_as_fp64():
    # torch.compile launches a kernel with its float arguments as fp64: its loops must keep their fp32 types
    launches = fp64_launches()
    assert len(launches) == 16
    for kernel, args, kwargs in launches:
        registers.compile_launch(kernel, args, kwargs, floats="fp64")


@compiles
def test_lla_backward_rows_name_every_kernel_at_each_tile():
    """The two parts of the LLA backward's block-diagonal q kernel and of its kv kernel as the op launches them
    with each tile of their autotune lists."""
    from regattn.ops.lla.backward import BACKWARD_TILES, BLOCKS_KV_TILES, PASS_B_TILES
    rows = list(registers.lla_backward_rows(head_dims=(32,), kinds=("diag",), T=256, H=2))
    assert [r["kind"] for r in rows] == ["diag/q1"] * len(BACKWARD_TILES[1]) + ["diag/q2"] * len(PASS_B_TILES[1]) + [
        "diag/kv1", "diag/kv2"] * len(BLOCKS_KV_TILES)
    tiles = [(r["BLOCK_M"], r["BLOCK_N"]) for r in rows]
    assert tiles == [(m, n) for m, n, _, _ in BACKWARD_TILES[1] + PASS_B_TILES[1]] + [
        (m, n) for m, n, _, _ in BLOCKS_KV_TILES for _ in range(2)]
    assert all(r["table"] and 0 < r["REG"] <= 255 and "error" not in r for r in rows), rows


@compiles
def test_mesanet_kernels_fit_an_h100():
    """MesaNet's nine launches at the MAD shape compile for sm_90 within an H100's shared memory."""
    rows = list(registers.mesanet_rows(kinds=("tf32x3",)))
    kernels = ("sums", "sums_backward", "precondition", "precondition_backward", "forward", "values", "factors",
               "inverse_factor_backward", "lower_inverse")
    assert [r["kind"] for r in rows] == [f"tf32x3/{k}" for k in kernels] and all(r["table"] for r in rows)
    for r in rows:
        assert r["SHARED"] <= registers.SM90_SHARED and 0 < r["REG"] <= 255, r


def pipelined_loop(body: str, slots: int = 1) -> str:
    """A TTGIR listing: a tile buffer of ``slots`` slots and a loop over ``body`` (``K``: a view of the buffer)."""
    return f"""
    %buf = ttg.local_alloc : () -> !ttg.memdesc<{slots}x64x64xbf16, #shared, #smem, mutable>
    %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %cst) -> (tensor<64x64xf32, #mma>) : i32 {{
      %K = ttg.memdesc_index %buf[%c0] : !ttg.memdesc<{slots}x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
      %Kt = ttg.memdesc_trans %K {{order = array<i32: 1, 0>}} : !ttg.memdesc<64x64xbf16> -> !ttg.memdesc<64x64xbf16>
{body}
      scf.yield %d : tensor<64x64xf32, #mma>
    }} loc(#loc1)
"""


PRODUCT = "      %d = ttng.warp_group_dot %a, %Kt, %acc {inputPrecision = 0 : i32, isAsync = true} : tensor<64x64xbf16>"
WAIT = "      %w:2 = ttng.warp_group_dot_wait %d, %Kt {pendings = 0 : i32} : tensor<64x64xf32, #mma>"
OTHER = "      %e = ttng.warp_group_dot %a, %x, %cst {inputPrecision = 0 : i32, isAsync = true} : tensor<64x64xbf16>"
COPY = "      %t = ttg.async_copy_global_to_local %ptrs, %K mask %m : tensor<64x64x!tt.ptr<bf16>> -> <64x64xbf16>"


def test_hazard_is_a_copy_into_the_buffer_a_product_in_flight_reads():
    assert registers.async_product_hazards(pipelined_loop("\n".join([PRODUCT, COPY]))) == 1
    assert registers.async_product_hazards(pipelined_loop("\n".join([PRODUCT, WAIT, COPY]))) == 0
    # a wait on a later product drains the earlier ones but the last ``pendings``
    assert registers.async_product_hazards(pipelined_loop("\n".join([PRODUCT, OTHER, WAIT, COPY]))) == 0
    one_pending = WAIT.replace("pendings = 0", "pendings = 1")
    assert registers.async_product_hazards(pipelined_loop("\n".join([PRODUCT, OTHER, one_pending, COPY]))) == 0
    assert registers.async_product_hazards(pipelined_loop("\n".join([OTHER, PRODUCT, one_pending, COPY]))) == 1
    # still in flight at the loop's end, it meets the next iteration's copy unless waited for first
    top_wait = WAIT.replace("%d, %Kt", "%acc")
    assert registers.async_product_hazards(pipelined_loop("\n".join([COPY, PRODUCT]))) == 1
    assert registers.async_product_hazards(pipelined_loop("\n".join([top_wait, COPY, PRODUCT]))) == 0
    # two slots: the next tile's copy goes to the other slot; a second copy comes back to the one being read
    assert registers.async_product_hazards(pipelined_loop("\n".join([top_wait, PRODUCT, COPY]))) == 1
    assert registers.async_product_hazards(pipelined_loop("\n".join([top_wait, PRODUCT, COPY]), slots=2)) == 0
    assert registers.async_product_hazards(pipelined_loop("\n".join([top_wait, PRODUCT, COPY, COPY]), slots=2)) == 1


@compiles
@pytest.mark.parametrize("kind,tile", [("diag", (64, 64, 4)), ("pairs", (64, 32, 4))])
def test_lla_direct_solves_read_no_buffer_being_overwritten(kind, tile):
    """BD-LLA's direct solves in bf16 at tiles whose first pass ran ``mu~``'s product past the next key tile's
    load into the buffer it read (``tiles.direct_moments``): nondeterministic outputs on the H200."""
    m, n, warps = tile
    config = dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=2)
    kernel, args, kwargs = registers.lla_forward_launch(config, None, 1, 512, 2, 128, registers.lla_blocks(kind, 128),
                                                        False)
    assert kwargs["SOLVER"] == {"diag": 1, "pairs": 2}[kind] and kwargs["MPREC"] == "parts"
    assert registers.async_product_hazards(registers.compile_launch(kernel, args, kwargs).asm["ttgir"]) == 0
