"""Array work of the collectives: dtypes, zero-copy buffer views, reduction kernels,
quantization, Top-k sparsification, and the buffers the data path moves bytes through (host and GPU staging,
pooled memory, a fused bucket's input read in place, an in-place input's backup).

Everything here takes the array module ``xp`` (numpy, or cupy for GPU buffers) beside the arrays it
works on, so one code path serves both. Nothing here does IO or touches trio.
"""

from ._buffers import Array as Array
from ._buffers import ArrayModule as ArrayModule
from ._buffers import as_array as as_array
from ._buffers import byte_view as byte_view
from ._buffers import in_kind_of as in_kind_of
from ._crossings import CROSSINGS as CROSSINGS
from ._dtypes import from_numpy_dtype as from_numpy_dtype
from ._dtypes import to_numpy_dtype as to_numpy_dtype
from ._gathered import Gathered as Gathered
from ._hash import simplehash as simplehash
from ._inputs import InputBackup as InputBackup
from ._kernels import combine_into as combine_into
from ._kernels import combine_parts as combine_parts
from ._kernels import copy_into as copy_into
from ._kernels import finalize_average as finalize_average
from ._kernels import reduce_into as reduce_into
from ._quantize import META_BYTES as META_BYTES
from ._quantize import Codec as Codec
from ._quantize import NonFiniteData as NonFiniteData
from ._quantize import check_quantization as check_quantization
from ._recycled import Recycled as Recycled
from ._staging import BufferPool as BufferPool
from ._staging import DeviceStaging as DeviceStaging
from ._staging import HostStaging as HostStaging
from ._staging import Lander as Lander
from ._staging import Sender as Sender
from ._staging import Staging as Staging
from ._staging import gpu_of as gpu_of
from ._staging import staging_for as staging_for
from ._topk import Selection as Selection
from ._topk import TopKLayout as TopKLayout
from ._topk import topk_feed_back as topk_feed_back
from ._topk import topk_select as topk_select
from ._topk import topk_sum as topk_sum
