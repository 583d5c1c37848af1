"""A strict stand-in for cupy: device arrays that live apart from host memory.

Theory of operation
-------------------
The library runs one algorithm for host and GPU buffers; the array module (``numpy``
or ``cupy``) is a parameter of the ops layer. On a machine without a GPU, the GPU
side of that code would go untested, and the mistakes it invites are exactly the ones
numpy forgives: handing a device array to something that needs host memory (a
socket, ``numpy.asarray``, a numpy ufunc), or mixing host and device operands. This
module is the array module such code sees in tests instead of cupy, and it forgives
none of them:

- A ``DeviceArray`` keeps its elements in a private numpy array. It exports no
  buffer, refuses ``__array__`` and numpy's ufuncs (``TypeError``, as cupy does), and
  compares, indexes and computes only with device arrays and scalars.
- The module's functions are numpy's, called on the private arrays; a host
  ``numpy.ndarray`` among their arguments is refused. Results come back as device
  arrays, reductions as 0-d ones (as cupy's do).
- Crossing between host and device is explicit and counted: ``asarray`` (and
  ``DeviceArray.set``) copies host to device, ``asnumpy`` (and ``DeviceArray.get``,
  and turning a 0-d array into a Python number) copies device to host. The counters
  ``to_device_bytes`` and ``to_host_bytes`` let a test check what would cross PCIe.
- Streams (``cuda.Stream``) order work as CUDA's do, and the double makes missing
  synchronization visible: an asynchronous copy (``asnumpy(..., blocking=False)``,
  ``set(..., stream=s)``) is only queued on its stream and happens when that stream
  is synchronized, or when a kernel runs with that stream current (``with s:``), since
  a kernel follows what was queued before it on its stream. Code that reads a
  host buffer before synchronizing the copy into it reads stale bytes, and a kernel
  that runs on another stream than the copy it needs computes on stale data; both
  show as wrong results. Streams behave as non-blocking ones (no implicit
  synchronization with the default stream). ``cuda.alloc_pinned_memory`` gives host
  memory that counts as pinned, and ``pageable_async_copies`` counts asynchronous
  copies from or to any other host memory (CUDA makes those synchronous).
- Several GPUs: ``cuda.Device(i)`` makes GPU ``i`` current in this thread (GPU 0
  until then), and arrays and streams belong to the GPU current when they were made
  (``array.device``). A kernel on an array of another GPU than the current one, a
  stream entered or used for a copy on another GPU than its own, are refused, as
  CUDA refuses them; so code that works in worker threads must make the buffers'
  GPU current there.

Results are computed by numpy, so they are bit for bit what the host path computes;
what the double checks is that the code keeps to device operations and explicit
copies, which is what makes it correct on cupy.
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy

__all__ = ["DeviceArray", "DeviceEvent", "DeviceStream", "StrictDevice"]


#: Calls that only make views or allocate: no kernel, so they do not order the
#: current stream's queued copies before them.
_METADATA_ONLY = frozenset({
    "view", "reshape", "ravel", "squeeze", "transpose", "swapaxes", "expand_dims",
    "as_strided", "shares_memory", "may_share_memory", "empty", "empty_like",
    "result_type", "can_cast", "iinfo", "finfo", "dtype",
})
#: DLPack's device type of CUDA memory.
_DLPACK_CUDA = 2


class _Pinned(bytearray):
    """Host memory the stand-in device counts as page-locked."""


class DeviceEvent:
    """A point in a stream's queue (``DeviceStream.record``)."""

    def __init__(self, stream: DeviceStream, position: int) -> None:
        self._stream = stream
        self._position = position

    def synchronize(self) -> None:
        """Wait until the stream got this far (and no further)."""
        self._stream._run_until(self._position)

    @property
    def done(self) -> bool:
        return self._stream._ran >= self._position


class DeviceStream:
    """A stream of the stand-in device: queued copies, run in order when synchronized
    or when a kernel runs with this stream current (see the module docstring)."""

    def __init__(self, device: StrictDevice, non_blocking: bool = False) -> None:
        self._device = device
        self.gpu = device.current_gpu()
        self._queue: list[Callable[[], None]] = []
        self._ran = 0  # how many queued copies have happened
        self._lock = threading.Lock()
        self.non_blocking = non_blocking
        device._all_streams.add(self)

    def enqueue(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(work)

    def synchronize(self) -> None:
        """Run everything queued, in order."""
        self._run_until(None)

    def _run_until(self, position: int | None) -> None:
        while True:
            with self._lock:
                if not self._queue or position is not None and self._ran >= position:
                    return
                work = self._queue.pop(0)
                self._ran += 1
            work()

    def record(self) -> DeviceEvent:
        """An event that completes once what is queued now has happened."""
        with self._lock:
            return DeviceEvent(self, self._ran + len(self._queue))

    @property
    def pending(self) -> int:
        return len(self._queue)

    def __enter__(self) -> DeviceStream:
        self._device._check_gpu(self.gpu, "a stream entered")
        self._device._streams().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        # Tasks of one thread may interleave their ``with`` blocks: leave this one.
        stack = self._device._streams()
        del stack[len(stack) - 1 - stack[::-1].index(self)]


class _Gpu:
    """``cuda.Device(i)``: GPU ``i``, made current in this thread by ``with``."""

    def __init__(self, device: StrictDevice, id: int = 0) -> None:  # noqa: A002 (cupy's name)
        self._device = device
        self.id = id

    def __enter__(self) -> _Gpu:
        gpus = getattr(self._device._local, "gpus", None)
        if gpus is None:
            gpus = self._device._local.gpus = [0]
        gpus.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        self._device._local.gpus.pop()

    def synchronize(self) -> None:
        self._device.synchronize()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Gpu) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)


class DeviceArray:
    """An array in the stand-in device's memory (see the module docstring)."""

    __slots__ = ("_device", "_gpu", "_host")
    #: numpy's ufuncs must not take it as an operand (nor its functions, below).
    __array_ufunc__ = None

    def __array_function__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a numpy function was given a device array; call the device module's own"
        )

    def __init__(self, device: StrictDevice, host: numpy.ndarray, gpu: int | None = None) -> None:
        self._device = device
        self._host = host
        self._gpu = device.current_gpu() if gpu is None else gpu

    @property
    def device(self) -> _Gpu:
        """The GPU this array lives on."""
        return _Gpu(self._device, self._gpu)

    # --- what stays on the device ------------------------------------------------------

    @property
    def dtype(self) -> numpy.dtype[Any]:
        return self._host.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._host.shape

    @property
    def ndim(self) -> int:
        return self._host.ndim

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def itemsize(self) -> int:
        return self._host.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        return self._host.strides

    @property
    def flags(self) -> Any:
        # cupy's flags have no ``writeable``: device memory is always writable.
        return types.SimpleNamespace(
            c_contiguous=self._host.flags.c_contiguous,
            f_contiguous=self._host.flags.f_contiguous,
            owndata=self._host.flags.owndata,
        )

    @property
    def data(self) -> Any:
        """The device pointer's stand-in: an opaque handle, not a buffer."""
        return types.SimpleNamespace(ptr=self._host.__array_interface__["data"][0])

    def __len__(self) -> int:
        return len(self._host)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_DLPACK_CUDA, self._gpu)

    def __dlpack__(self, stream: Any = None) -> DeviceArray:
        """The stand-in's capsule: the array itself, which only its device imports."""
        return self

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._host, name)
        if isinstance(attribute, numpy.ndarray):  # .T, .real, .base: views, on the device
            return self._device._lift(attribute, self._gpu)
        if attribute is None:  # .base of an array that owns its memory
            return None
        if not callable(attribute):  # .ctypes, .__array_interface__: host addresses
            raise AttributeError(f"DeviceArray has no attribute {name!r}")
        return self._device._wrap(attribute, name, self)

    def __getitem__(self, index: Any) -> Any:
        return self._device._lift(self._host[self._device._lower(index, "an index")], self._gpu)

    def __setitem__(self, index: Any, value: Any) -> None:
        device = self._device
        device._kernel()
        device._check_gpu(self._gpu, "a device array written")
        self._host[device._lower(index, "an index")] = device._lower(
            value, "a value assigned to a device array", kernel=True
        )

    # --- crossings (explicit, counted) -------------------------------------------------

    def get(
        self, stream: Any = None, out: numpy.ndarray | None = None, blocking: bool = True
    ) -> numpy.ndarray:
        """Copy to host memory (``out`` if given)."""
        return self._device.asnumpy(self, stream=stream, out=out, blocking=blocking)

    def set(self, host: numpy.ndarray, stream: Any = None) -> None:
        """Copy ``host`` (same shape and dtype) into this array; queued on ``stream``
        if one is given (asynchronous), else done now."""
        if not isinstance(host, numpy.ndarray) or host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError("set() needs a host array of the same shape and dtype")
        self._device.to_device_bytes += host.nbytes
        target = self._host

        def copy() -> None:
            target[...] = host

        self._device._copy(copy, stream, blocking=stream is None, host=host, gpu=self._gpu)

    def _scalar(self) -> Any:
        if self._host.size != 1:
            raise TypeError("only a one-element device array converts to a Python scalar")
        self._device._kernel()
        self._device.to_host_bytes += self._host.nbytes
        return self._host.reshape(()).item()

    def __int__(self) -> int:
        return int(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def __index__(self) -> int:
        return int(self._scalar())

    # --- what is refused ---------------------------------------------------------------

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "implicit conversion of a device array to a host array is not allowed; "
            "copy it with asnumpy() or .get()"
        )

    def __iter__(self) -> Any:
        raise TypeError("iterating over a device array would copy it element by element")

    def tolist(self) -> Any:
        raise TypeError("tolist() copies a device array to host memory; use asnumpy() first")

    def tobytes(self) -> Any:
        raise TypeError("tobytes() copies a device array to host memory; use asnumpy() first")


def _operator(name: str) -> Callable[..., Any]:
    def apply(self: DeviceArray, *others: Any) -> Any:
        device = self._device
        device._kernel()
        device._check_gpu(self._gpu, "an operand")
        lowered = [device._lower(other, "an operand", kernel=True) for other in others]
        return device._lift(getattr(self._host, name)(*lowered))

    apply.__name__ = name
    return apply


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__mod__", "__pow__", "__neg__", "__abs__",
    "__and__", "__or__", "__xor__", "__invert__", "__lshift__", "__rshift__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__", "__ixor__",
):
    setattr(DeviceArray, _name, _operator(_name))
DeviceArray.__hash__ = None  # type: ignore[assignment]  # == is elementwise


class StrictDevice:
    """The array module of the stand-in device: ``numpy``'s functions, on device arrays
    only, with explicit, counted copies (see the module docstring). Pass it where the
    code takes ``xp``; install it as ``cupy`` (``sys.modules``) to have buffers
    recognised as GPU ones."""

    __name__ = "cupy"

    def __init__(self) -> None:
        self.ndarray = DeviceArray
        self.to_device_bytes = 0
        self.to_host_bytes = 0
        self.pageable_async_copies = 0
        self._local = threading.local()
        self._all_streams: weakref.WeakSet[DeviceStream] = weakref.WeakSet()
        self._nulls: dict[int, DeviceStream] = {}
        self.cuda = types.SimpleNamespace(
            Device=partial(_Gpu, self),
            Stream=partial(DeviceStream, self),
            alloc_pinned_memory=_Pinned,
            get_current_stream=self.current_stream,
        )
        self.lib = types.SimpleNamespace(
            stride_tricks=types.SimpleNamespace(
                as_strided=self._wrap(numpy.lib.stride_tricks.as_strided, "as_strided")
            )
        )

    # --- GPUs -----------------------------------------------------------------------------

    def current_gpu(self) -> int:
        """The GPU current in this thread (``cuda.Device(i)``; 0 by default)."""
        gpus: list[int] = getattr(self._local, "gpus", None) or [0]
        return gpus[-1]

    def _check_gpu(self, gpu: int, what: str) -> None:
        current = self.current_gpu()
        if gpu != current:
            raise ValueError(
                f"{what} belongs to GPU {gpu} while GPU {current} is current in this thread "
                "(make it current with cuda.Device)"
            )

    # --- crossings ----------------------------------------------------------------------

    def asarray(self, obj: Any, dtype: Any = None) -> DeviceArray:
        """A device array of ``obj``: a copy of a host array (counted), or ``obj``
        itself if it is a device array of that dtype."""
        if isinstance(obj, DeviceArray):
            return obj if dtype is None or obj.dtype == dtype else obj.astype(dtype)
        host = numpy.array(obj, dtype=dtype, copy=True)
        self.to_device_bytes += host.nbytes
        return DeviceArray(self, host)

    def asnumpy(
        self, array: Any, stream: Any = None, out: numpy.ndarray | None = None,
        blocking: bool = True,
    ) -> numpy.ndarray:
        """A host copy of a device array (into ``out`` if given), counted; with
        ``blocking=False`` only queued on ``stream`` (or the current one): ``out``
        holds it once that stream is synchronized."""
        if not isinstance(array, DeviceArray):
            raise TypeError(f"asnumpy() needs a device array, got {type(array).__name__}")
        self.to_host_bytes += array.nbytes
        if out is None:
            if not blocking:
                raise ValueError("an asynchronous copy needs out=")
            self._kernel(stream)
            return array._host.copy()
        if out.shape != array.shape or out.dtype != array.dtype:
            raise ValueError("out= must have the device array's shape and dtype")
        source = array._host

        def copy() -> None:
            out[...] = source

        self._copy(copy, stream, blocking=blocking, host=out, gpu=array._gpu)
        return out

    # --- streams -----------------------------------------------------------------------

    def _streams(self) -> list[DeviceStream]:
        stack: list[DeviceStream] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current_stream(self) -> DeviceStream:
        """The stream entered last in this thread, else the current GPU's default one."""
        gpu = self.current_gpu()
        stack = [s for s in self._streams() if s.gpu == gpu]
        return stack[-1] if stack else self._null(gpu)

    def _null(self, gpu: int) -> DeviceStream:
        """GPU ``gpu``'s default stream."""
        if gpu not in self._nulls:
            with _Gpu(self, gpu):
                self._nulls[gpu] = DeviceStream(self)
        return self._nulls[gpu]

    def synchronize(self) -> None:
        """Wait for every stream (``cupy.cuda.Device().synchronize()``)."""
        for stream in list(self._all_streams):
            stream.synchronize()

    def _kernel(self, stream: Any = None) -> None:
        """A kernel is about to run on ``stream`` (the current one): what was queued on
        that stream before it happens first."""
        (stream or self.current_stream()).synchronize()

    def _copy(
        self, copy: Callable[[], None], stream: Any, *, blocking: bool, host: numpy.ndarray,
        gpu: int,
    ) -> None:
        if stream is not None and stream.gpu != gpu:
            raise ValueError(
                f"a copy of an array of GPU {gpu} on a stream of GPU {stream.gpu}"
            )
        stream = stream or self._null(gpu)
        if blocking:
            stream.synchronize()
            copy()
            return
        if not _pinned(host):
            self.pageable_async_copies += 1
        stream.enqueue(copy)

    def from_dlpack(self, obj: Any) -> DeviceArray:
        """Import a DLPack exporter of this device's memory (a device array, or an
        object whose ``__dlpack__`` hands one over, as a CUDA tensor's would)."""
        if not isinstance(obj, DeviceArray):
            device_type = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else 1
            obj = obj.__dlpack__() if int(device_type) == _DLPACK_CUDA else None
        if isinstance(obj, DeviceArray) and obj._device is self:
            return obj
        raise TypeError("the stand-in device imports only its own arrays")

    def empty(self, shape: Any, dtype: Any = float) -> DeviceArray:
        """Uninitialised device memory: filled with a pattern (bytes 0xA5), so reading
        what was never written shows."""
        host = numpy.empty(shape, dtype=dtype)
        host.view(numpy.uint8)[...] = 0xA5
        return DeviceArray(self, host)

    # --- everything else: numpy's, on device arrays ------------------------------------

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(numpy, name)
        if isinstance(attribute, type) or not callable(attribute):
            return attribute  # dtypes, scalar types, constants
        return self._wrap(attribute, name)

    def _wrap(
        self, function: Callable[..., Any], name: str, owner: DeviceArray | None = None
    ) -> Callable[..., Any]:
        touches_data = name not in _METADATA_ONLY

        def call(*args: Any, **kwargs: Any) -> Any:
            if touches_data:
                self._kernel()
                if owner is not None:
                    self._check_gpu(owner._gpu, f"the array of {name}()")
            lowered_args = [self._lower(a, f"an argument of {name}()", kernel=touches_data)
                            for a in args]
            lowered_kwargs = {k: self._lower(v, f"{k}= of {name}()", kernel=touches_data)
                              for k, v in kwargs.items()}
            result = function(*lowered_args, **lowered_kwargs)
            # A view stays on its array's GPU; anything computed is on the current one.
            views = [a for a in (owner, *args) if isinstance(a, DeviceArray)]
            return self._lift(result, None if touches_data or not views else views[0]._gpu)

        call.__name__ = name
        return call

    def _lower(self, value: Any, what: str, kernel: bool = False) -> Any:
        """A device array's private host array; host arrays refused (and, for a
        ``kernel``, arrays of another GPU than the current one)."""
        if isinstance(value, DeviceArray):
            if value._device is not self:
                raise TypeError(f"{what} lives on another device")
            if kernel:
                self._check_gpu(value._gpu, what)
            return value._host
        if isinstance(value, numpy.ndarray):
            raise TypeError(
                f"{what} is a host array: copy it to the device first (asarray), as cupy "
                "requires"
            )
        if isinstance(value, list | tuple):
            return type(value)(self._lower(item, what, kernel) for item in value)
        if isinstance(value, slice):
            return slice(*(self._lower(part, what) for part in (value.start, value.stop, value.step)))
        return value

    def _lift(self, value: Any, gpu: int | None = None) -> Any:
        """Device arrays of what numpy returned, on ``gpu`` (default: the current)."""
        if isinstance(value, numpy.ndarray):
            return DeviceArray(self, value, gpu)
        if isinstance(value, numpy.generic):
            return DeviceArray(self, numpy.asarray(value), gpu)  # cupy reduces to 0-d arrays
        if isinstance(value, tuple):
            return tuple(self._lift(item, gpu) for item in value)
        if isinstance(value, list):
            return [self._lift(item, gpu) for item in value]
        return value


def _pinned(array: numpy.ndarray) -> bool:
    """Whether ``array`` views memory from ``cuda.alloc_pinned_memory``."""
    base: Any = array
    while isinstance(base, numpy.ndarray):
        base = base.base
    if isinstance(base, memoryview):  # numpy.frombuffer's
        base = base.obj
    return isinstance(base, _Pinned)
