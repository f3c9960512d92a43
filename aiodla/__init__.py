"""aiodla: asyncio-native concurrent inference on NVIDIA's Deep Learning Accelerator."""

from ._batching import Batching as Batching
from ._batching import BatchStatistics as BatchStatistics
from ._blocking import BlockingEngine as BlockingEngine
from ._detect import Detect as Detect
from ._detect import Detections as Detections
from ._device_arrays import DeviceTensor as DeviceTensor
from ._engine import Engine as Engine
from ._engine import EngineState as EngineState
from ._errors import AiodlaError as AiodlaError
from ._errors import ComputeError as ComputeError
from ._errors import ConfigurationError as ConfigurationError
from ._errors import DeviceError as DeviceError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import EngineDeadError as EngineDeadError
from ._errors import InputError as InputError
from ._errors import InputTypeError as InputTypeError
from ._errors import InputValueError as InputValueError
from ._errors import LoadableFormatError as LoadableFormatError
from ._errors import ModelError as ModelError
from ._errors import PostprocessError as PostprocessError
from ._errors import QueueFullError as QueueFullError
from ._errors import RequestTimeoutError as RequestTimeoutError
from ._errors import RuntimeUnavailableError as RuntimeUnavailableError
from ._errors import StreamClosedError as StreamClosedError
from ._errors import TaskError as TaskError
from ._errors import VideoSourceError as VideoSourceError
from ._errors import WorkerLostError as WorkerLostError
from ._options import EngineKeywords as EngineKeywords
from ._options import EngineOptions as EngineOptions
from ._options import ProcessIsolation as ProcessIsolation
from ._preprocess import Geometry as Geometry
from ._preprocess import ImagePreprocess as ImagePreprocess
from ._session import FrameResult as FrameResult
from ._session import LatestFrameStream as LatestFrameStream
from ._session import StreamState as StreamState
from ._session import StreamStatistics as StreamStatistics
from ._shared_cores import Cores as Cores
from ._shared_cores import CoreSet as CoreSet
from ._statistics import CoreStatistics as CoreStatistics
from ._statistics import EngineHealth as EngineHealth
from ._statistics import EngineStatistics as EngineStatistics
from ._statistics import Histogram as Histogram
from ._statistics import LatencySummary as LatencySummary
from ._statistics import StageTimes as StageTimes
from ._statistics import WorkerStatistics as WorkerStatistics
from ._tensors import TensorSpec as TensorSpec
from ._trace import TraceRecorder as TraceRecorder
from ._video_frame import VideoFrame as VideoFrame
from ._video_source import VideoSource as VideoSource
from ._video_source import VideoSourceState as VideoSourceState
from ._video_source import VideoSourceStatistics as VideoSourceStatistics
from .runtime import EmulatedRuntime as EmulatedRuntime

__version__ = "0.1.0.dev0"

__all__ = (
    "AiodlaError",
    "BatchStatistics",
    "Batching",
    "BlockingEngine",
    "ComputeError",
    "ConfigurationError",
    "CoreSet",
    "CoreStatistics",
    "Cores",
    "Detect",
    "Detections",
    "DeviceError",
    "DeviceTensor",
    "EmulatedRuntime",
    "Engine",
    "EngineClosedError",
    "EngineDeadError",
    "EngineHealth",
    "EngineKeywords",
    "EngineOptions",
    "EngineState",
    "EngineStatistics",
    "FrameResult",
    "Geometry",
    "Histogram",
    "ImagePreprocess",
    "InputError",
    "InputTypeError",
    "InputValueError",
    "LatencySummary",
    "LatestFrameStream",
    "LoadableFormatError",
    "ModelError",
    "PostprocessError",
    "ProcessIsolation",
    "QueueFullError",
    "RequestTimeoutError",
    "RuntimeUnavailableError",
    "StageTimes",
    "StreamClosedError",
    "StreamState",
    "StreamStatistics",
    "TaskError",
    "TensorSpec",
    "TraceRecorder",
    "VideoFrame",
    "VideoSource",
    "VideoSourceError",
    "VideoSourceState",
    "VideoSourceStatistics",
    "WorkerLostError",
    "WorkerStatistics",
)
