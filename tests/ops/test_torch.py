"""torch tensors through DLPack, bfloat16 included. Skipped where torch is not installed (CI)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy
import pytest

from pccl_trio import InvalidArgument, ReduceOp
from pccl_trio.ops import as_array, byte_view, finalize_average, reduce_into

from .support import needs_writable_dlpack

torch: Any = pytest.importorskip("torch")
pytestmark = needs_writable_dlpack

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_cpu_tensors_are_viewed_without_copying(dtype_name: str) -> None:
    tensor = torch.zeros((2, 3), dtype=getattr(torch, dtype_name))
    xp, view = as_array(tensor, name="send")
    assert xp is numpy and view.shape == (6,) and view.flags.writeable
    assert view.ctypes.data == tensor.data_ptr()
    view[4] = 5
    assert tensor[1, 1].item() == 5


def test_bfloat16_tensors_keep_their_bits_and_reduce_as_bfloat16() -> None:
    tensor = torch.tensor([1.5, -2.0, 3.0e38, 2.0**-100], dtype=torch.bfloat16)
    _, view = as_array(tensor, name="send")
    assert view.dtype == ml_dtypes.bfloat16
    assert view.view(numpy.int16).tolist() == tensor.view(torch.int16).tolist()
    other = torch.tensor([0.25, 0.5, 3.0e38, 2.0**-100], dtype=torch.bfloat16)
    reduce_into(numpy, view, as_array(other, name="recv")[1], ReduceOp.SUM)
    # 3e38 + 3e38 overflows bfloat16 to inf, as torch's own bfloat16 sum does: nothing widens.
    inf = float("inf")
    assert torch.equal(tensor, torch.tensor([1.75, -1.5, inf, 2.0**-99], dtype=torch.bfloat16))
    finalize_average(numpy, view, 2)
    assert torch.equal(tensor, torch.tensor([0.875, -0.75, inf, 2.0**-100], dtype=torch.bfloat16))


def test_reduction_matches_torch_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(7)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        a = torch.randn(4099, generator=generator).to(dtype)
        b = torch.randn(4099, generator=generator).to(dtype)
        for op, torch_op in ((ReduceOp.SUM, torch.add), (ReduceOp.PROD, torch.mul),
                             (ReduceOp.MAX, torch.maximum), (ReduceOp.MIN, torch.minimum)):
            dst = a.clone()
            reduce_into(numpy, as_array(dst, name="dst")[1], as_array(b, name="src")[1], op)
            assert torch.equal(dst, torch_op(a, b)), (dtype, op)


def test_byte_view_of_a_tensor_writes_the_tensor() -> None:
    tensor = torch.zeros(2, dtype=torch.int32)
    view = byte_view(*as_array(tensor, name="recv"))
    view[4:8] = (7).to_bytes(4, "little")
    assert tensor.tolist() == [0, 7]


@pytest.mark.parametrize(
    "make",
    [lambda: torch.zeros(4, 4).t(), lambda: torch.zeros(8)[::2],
     lambda: torch.zeros(4, 4, dtype=torch.bfloat16).t()],
    ids=["transposed", "strided", "bfloat16-transposed"],
)
def test_non_contiguous_tensors_are_rejected_with_the_fix(make: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"^send: .*not C-contiguous.*\.contiguous\(\)"):
        as_array(make(), name="send")


@pytest.mark.parametrize(
    "make", [lambda: torch.ones(4)._neg_view(), lambda: torch.ones(4, dtype=torch.complex64).conj()],
    ids=["negated", "conjugated"],
)
def test_lazy_negated_or_conjugated_views_are_rejected(make: Any) -> None:
    # Their memory does not hold their values: reducing it would reduce other numbers.
    with pytest.raises(InvalidArgument, match=r"^send: .*lazy negated or conjugated.*resolve_neg"):
        as_array(make(), name="send")


def test_model_parameters_are_viewed_without_copying_and_written_in_place() -> None:
    layer = torch.nn.Linear(4, 3)
    _, weight = as_array(layer.weight, name="send")
    assert weight.ctypes.data == layer.weight.data_ptr()
    weight[:] = 2.0
    assert bool((layer.weight == 2.0).all()) and layer.weight.requires_grad


@pytest.mark.parametrize("dtype_name", ["bool", "complex64", "float8_e4m3fn"])
def test_unsupported_tensor_dtypes_are_rejected(dtype_name: str) -> None:
    with pytest.raises(InvalidArgument, match="^send: "):
        as_array(torch.zeros(3, dtype=getattr(torch, dtype_name)), name="send")


@pytest.mark.parametrize("dtype_name", ["float8_e4m3fn", "float8_e5m2"])
def test_unsupported_dtypes_numpy_cannot_hold_are_named(dtype_name: str) -> None:
    """float8 has no numpy dtype, so numpy's message cannot name it: torch's is used."""
    with pytest.raises(InvalidArgument, match=rf"^send: dtype torch.{dtype_name} is not "
                       r"supported; supported dtypes: .*float32.*\.to\(torch.float32\)"):
        as_array(torch.zeros(3, dtype=getattr(torch, dtype_name)), name="send")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_without_dense_memory_are_refused_with_the_way_out(dtype: torch.dtype) -> None:
    with pytest.raises(InvalidArgument, match=r"^send: a torch.sparse_coo tensor .*\.to_dense\(\)"):
        as_array(torch.ones(4, 4, dtype=dtype).to_sparse(), name="send")
    with pytest.raises(InvalidArgument, match=r"^send: a tensor on the meta device .*to_empty"):
        as_array(torch.ones(4, dtype=dtype, device="meta"), name="send")


def test_a_missing_gradient_is_named() -> None:
    """A parameter's .grad is None before backward() and for parameters the loss did
    not use: the message says so."""
    grad = torch.nn.Linear(2, 2).weight.grad
    with pytest.raises(InvalidArgument, match=r"^tensors\[0\]: .*NoneType; a parameter's \.grad "
                       "is None before backward"):
        as_array(grad, name="tensors[0]")


def test_finalize_average_matches_torchs_division_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(11)
    for dtype in (torch.int8, torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        values = torch.randint(info.min, info.max, (4099,), dtype=dtype, generator=generator)
        for world_size in (2, 3, 7, 100):
            array = values.clone()
            finalize_average(numpy, as_array(array, name="recv")[1], world_size)
            expected = torch.div(values, world_size, rounding_mode="trunc")
            assert torch.equal(array, expected), (dtype, world_size)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        values = torch.randn(4099, generator=generator).to(dtype)
        for world_size in (2, 3, 7, 100):
            array = values.clone()
            finalize_average(numpy, as_array(array, name="recv")[1], world_size)
            assert torch.equal(array, values / world_size), (dtype, world_size)


class _OnTheGpu(torch.Tensor):  # type: ignore[misc]
    """A host tensor that says it lives on a CUDA device, as a GPU tensor's DLPack
    export does (a subclass, as users' tensor types are)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA, device 0


@pytest.mark.parametrize("where", ["stand-in", "cuda"])
def test_bfloat16_gpu_tensors_are_refused_with_the_way_out(where: str) -> None:
    """cupy has no bfloat16: a bfloat16 tensor on a GPU gets an error that says so and
    what to do (on a real GPU where torch has CUDA, else a tensor that says it is on one)."""
    if where == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs torch with CUDA and a GPU")
        tensor = torch.zeros(8, dtype=torch.bfloat16, device="cuda")
    else:
        tensor = torch.zeros(8, dtype=torch.bfloat16).as_subclass(_OnTheGpu)
    with pytest.raises(InvalidArgument, match=r"^send: bfloat16 GPU tensors are not supported "
                       r"\(cupy has no bfloat16 dtype\); reduce in float32 or float16"):
        as_array(tensor, name="send")
