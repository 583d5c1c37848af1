"""Zero-copy views of the caller's buffers, and the array module that operates on each.

The all-reduce writes its result into the caller's buffer, so every accepted input is viewed, never
copied: a C-contiguous numpy array, a cupy array, or any object that exports DLPack (a torch tensor,
say). The view is flat because the reduction is elementwise and the shape travels nowhere.
A torch tensor that requires grad (a model's parameter) is viewed through ``detach()``: its
memory, written outside autograd, as an optimizer's step writes it.

numpy cannot import torch's bfloat16 through DLPack (it has no such builtin dtype), so a torch
bfloat16 tensor is exported as int16, the same bits, and viewed back as ``ml_dtypes.bfloat16``.
torch and cupy are optional: neither is imported unless the caller hands over one of their objects.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, TypeAlias

import numpy

from .._errors import InvalidArgument
from .._types import DataType
from ._dtypes import _SEEN, SUPPORTED, SUPPORTED_NAMES, from_numpy_dtype, to_numpy_dtype

__all__ = ["Array", "ArrayModule", "as_array", "byte_view", "in_kind_of"]

Array: TypeAlias = Any
"""A ``numpy.ndarray`` or ``cupy.ndarray``; the two share no static type."""

ArrayModule: TypeAlias = Any
"""The module (``numpy`` or ``cupy``) whose functions create and operate on an :data:`Array`."""

# DLPack device types whose memory the host cannot address: kDLCUDA, kDLROCM.
_DLPACK_GPU_DEVICES = frozenset({2, 10})


_ACCEPTED = (
    "a C-contiguous numpy.ndarray, a cupy.ndarray, or an object implementing __dlpack__ (e.g. a "
    "torch.Tensor)"
)


def as_array(obj: object, *, name: str) -> tuple[ArrayModule, Array]:
    """View ``obj`` as a flat, writable array, without copying.

    Args:
        obj: the caller's buffer; see the module docstring for what is accepted.
        name: the argument's name in the caller's API (e.g. ``"send"``), used in error messages.

    Returns:
        ``(xp, array)``: the array module (``numpy`` or ``cupy``) and a 1-D C-contiguous view of
        ``obj``'s memory; writing to it writes to ``obj``.

    Raises:
        InvalidArgument: ``obj`` is of an unsupported kind or dtype, not C-contiguous, read-only, or
            on a GPU while cupy is not installed.
    """
    if type(obj) is numpy.ndarray:
        # The common case, checked with the fewest calls (a step passes hundreds).
        flags = obj.flags
        if flags.c_contiguous and flags.writeable and obj.dtype in _SEEN:
            return numpy, obj if obj.ndim == 1 else obj.reshape(-1)
    if isinstance(obj, numpy.ndarray):
        # A subclass's __array_ufunc__ must not run inside the reduction kernels.
        array = obj if type(obj) is numpy.ndarray else obj.view(numpy.ndarray)
        return numpy, _flat_view(numpy, array, name=name)
    # A cupy array exists only once cupy was imported: look it up, never import it.
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return cupy, _flat_view(cupy, obj, name=name)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj, name=name)
    raise InvalidArgument(
        f"{name}: expected {_ACCEPTED}, got {type(obj).__module__}.{type(obj).__qualname__}; "
        + (
            "a parameter's .grad is None before backward(), and stays None for a parameter "
            "the loss did not use: leave those out, or give them zeros"
            if obj is None else
            "wrap raw bytes with numpy.frombuffer(bytearray_object, dtype=...)"
        )
    )


def byte_view(xp: ArrayModule, array: Array) -> memoryview:
    """A writable, flat ``uint8`` memoryview of a numpy array's memory, for socket IO.

    Raises:
        InvalidArgument: ``array`` is not a writable C-contiguous numpy array; GPU arrays must be
            staged through host memory by the caller.
    """
    if xp is not numpy or not isinstance(array, numpy.ndarray):
        raise InvalidArgument(
            "byte_view needs a numpy array; stage GPU arrays through a host (numpy) buffer first"
        )
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise InvalidArgument("byte_view needs a writable C-contiguous array; pass one from as_array")
    # Flatten before changing the dtype: a 0-d array cannot change its itemsize.
    return array.reshape(-1).view(numpy.uint8).data


def _from_dlpack(obj: Any, *, name: str) -> tuple[ArrayModule, Array]:
    """View a DLPack exporter as a numpy array (host memory) or a cupy array (GPU memory)."""
    # A torch tensor, subclasses included (torch is imported if the caller made one).
    torch = sys.modules.get("torch")
    from_torch = torch is not None and isinstance(obj, torch.Tensor)
    if from_torch and getattr(obj, "requires_grad", False):
        # A model's parameter: its data, the same memory, written outside autograd as an
        # optimizer's step is (DLPack refuses a tensor that requires grad).
        obj = obj.detach()
    torch_bfloat16 = from_torch and repr(obj.dtype) == "torch.bfloat16"
    if from_torch and not torch_bfloat16:
        try:
            # A host tensor: the same memory as through DLPack, for a fraction of the
            # cost (a gradient list has hundreds of tensors).
            host = obj.numpy()
        except (RuntimeError, TypeError):
            pass  # on a device, or a tensor numpy cannot express: DLPack decides below
        else:
            return numpy, _flat_view(numpy, host, name=name)
    if from_torch:
        if obj.is_neg() or obj.is_conj():
            # Lazy negation or conjugation: the memory does not hold the values, and
            # DLPack would export the memory as if it did.
            raise InvalidArgument(
                f"{name}: the tensor is a lazy negated or conjugated view (its memory does "
                "not hold its values); pass .resolve_neg().resolve_conj() and copy the "
                "result back"
            )
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    try:
        device_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        if from_torch:
            _check_torch_tensor(torch, obj, name=name)
        raise InvalidArgument(
            f"{name}: the {kind} cannot say where its memory is through DLPack ({error}); "
            "pass a numpy array or a tensor in host or GPU memory"
        ) from error
    xp: ModuleType
    if int(device_type) in _DLPACK_GPU_DEVICES:
        if torch_bfloat16:
            raise InvalidArgument(
                f"{name}: bfloat16 GPU tensors are not supported (cupy has no bfloat16 dtype); "
                "reduce in float32 or float16, or stage the tensor through host memory"
            )
        xp = _import_cupy(name=name, what=f"a GPU {kind}")
    else:
        xp = numpy
    try:
        # A bfloat16 tensor crosses as int16 (numpy has no bfloat16 of its own); obj is
        # then a torch tensor, so this only fetches the module.
        exported = obj.view(importlib.import_module("torch").int16) if torch_bfloat16 else obj
        array = xp.from_dlpack(exported)
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        if from_torch:
            _check_torch_tensor(torch, obj, name=name)
        raise InvalidArgument(f"{name}: could not view the {kind} through DLPack: {error}") from error
    if torch_bfloat16:
        array = array.view(to_numpy_dtype(DataType.BFLOAT16))
    if xp is numpy and not array.flags.writeable:
        # Not always the exporter's doing (numpy/numpy#28599): numpy before 2.2.5 imports every
        # DLPack array read-only, and later numpy still does for the legacy unversioned protocol.
        raise InvalidArgument(
            f"{name}: numpy {numpy.__version__} imported the {kind} read-only, but the all-reduce "
            "writes its result into it; the exporter may be read-only, or numpy too old (before "
            "2.2.5 numpy imports every DLPack array read-only, and later numpy does so for exporters "
            "of the legacy unversioned DLPack protocol): upgrade numpy and the exporter's library, "
            "or pass a writable numpy array"
        )
    return xp, _flat_view(xp, array, name=name)


def _check_torch_tensor(torch: Any, tensor: Any, *, name: str) -> None:
    """Why DLPack refused a torch tensor, in torch's terms, where torch says more
    (called only once it refused: the tensors it takes pay nothing).

    Raises:
        InvalidArgument: a tensor that is not dense, has no memory (the meta device), or
            has a dtype with no counterpart here.
    """
    if tensor.layout is not torch.strided:
        raise InvalidArgument(
            f"{name}: a {tensor.layout} tensor has no dense memory to reduce in place; "
            "pass a dense one (.to_dense()) and copy the result back"
        )
    if tensor.device.type == "meta":
        raise InvalidArgument(
            f"{name}: a tensor on the meta device has no memory; materialize it first "
            "(e.g. module.to_empty(device='cpu'))"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in SUPPORTED:
        raise InvalidArgument(
            f"{name}: dtype torch.{dtype} is not supported; supported dtypes: {SUPPORTED_NAMES}; "
            "convert it first (e.g. .to(torch.float32)) and copy the result back"
        )


def _flat_view(xp: ArrayModule, array: Array, *, name: str) -> Array:
    """Check ``array`` can be reduced into in place, and flatten it without copying."""
    try:
        from_numpy_dtype(array.dtype)
    except InvalidArgument as error:
        raise InvalidArgument(
            f"{name}: {error}; convert it first (e.g. .astype(numpy.float32)) and copy the result back"
        ) from error
    flags = array.flags
    if not flags.c_contiguous:
        raise InvalidArgument(
            f"{name}: the array is not C-contiguous (shape {tuple(array.shape)}, strides "
            f"{tuple(array.strides)}); pass a contiguous copy (numpy.ascontiguousarray, or torch's "
            ".contiguous()) and copy the result back"
        )
    # cupy arrays have no writeable flag: device memory is always writable.
    if not getattr(flags, "writeable", True):
        raise InvalidArgument(
            f"{name}: the array is read-only, but the all-reduce writes its result into it; "
            "pass a writable array (e.g. numpy.array(x) makes a writable copy)"
        )
    # C-contiguous, so reshape returns a view, never a copy.
    return array.reshape(-1)


def _import_cupy(*, name: str, what: str) -> ModuleType:
    """Import cupy, which GPU buffers need and CPU-only installs lack."""
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise InvalidArgument(
            f"{name}: {what} lives in GPU memory, which needs cupy; install it with "
            "pip install 'pccl_trio[gpu]', or pass a host (CPU) buffer"
        ) from error


def in_kind_of(original: Any, array: Array) -> Any:
    """``array``, a result the library made (numpy or cupy), as the kind of the
    caller's ``original``: a torch tensor (on the same memory, through DLPack) for a
    torch input, the array itself otherwise. A bfloat16 result crosses as int16, the
    same bits, as it came in."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(original, torch.Tensor):
        return array
    if str(array.dtype) == "bfloat16":
        return torch.from_dlpack(array.view(numpy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(array)

