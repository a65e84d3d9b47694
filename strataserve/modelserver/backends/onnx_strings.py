"""BYTES <-> onnxruntime tensor(string), byte for byte, within what onnxruntime's Python API can carry.

onnxruntime stores strings as std::string, but its Python API takes them only as: an object array of ``str``
(sent as UTF-8 at full length, NULs included; a ``bytes`` element would be sent as its repr), a ``V<n>`` (void)
array (each element exactly n raw bytes), or an ``S`` array (read as C strings, past the element when it fills
its width: unusable). It returns them only as ``str`` decoded from UTF-8. So valid UTF-8 goes as ``str`` (exact,
NULs too), other bytes go as ``V<n>`` when every element of the tensor has the same length (exact), and the rest
cannot be passed: that request gets a 400 naming the input rather than a silently altered string.
"""

from __future__ import annotations

import numpy as np

from strataserve.types.tensors import ModelServerError


def string_input(model: str, name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES input (object array of bytes / str) as onnxruntime takes it without changing a byte."""
    items = [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
    try:
        text = [v.decode("utf-8") for v in items]
    except UnicodeDecodeError:
        text = None
    if text is not None:
        return _object_array(text, array.shape)
    lengths = {len(v) for v in items}
    if len(lengths) == 1:
        return np.frombuffer(b"".join(items), dtype=f"V{lengths.pop()}").reshape(array.shape)
    raise ModelServerError("invalid_argument", f"model '{model}': input '{name}' holds bytes that are not UTF-8 in "
                           "elements of different lengths; onnxruntime's Python API takes raw (non-UTF-8) strings "
                           "only when every element of the tensor has the same length")


def string_output(array: np.ndarray) -> np.ndarray:
    """A tensor(string) output (object array of str) as BYTES (object array of bytes)."""
    return _object_array([v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in array.reshape(-1)],
                         array.shape)


def _object_array(values: list, shape: tuple[int, ...]) -> np.ndarray:
    # element by element: numpy would route a list of str / bytes through a U / S array, dropping trailing NULs
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out.reshape(shape)


def string_output_error(model: str, outputs: list[str], feed: dict[str, np.ndarray],
                        error: UnicodeDecodeError) -> ModelServerError:
    """The error for a string output onnxruntime could not return (it is not UTF-8): the client's when one of its
    inputs was not UTF-8 either (the model passed those bytes on), else the model's."""
    raw = [k for k, v in feed.items() if v.dtype.kind == "V"]
    if raw:
        return ModelServerError("invalid_argument", f"model '{model}': input(s) {raw} hold bytes that are not "
                                f"UTF-8 and a string output of {outputs} carries such bytes, which onnxruntime's "
                                f"Python API returns only as UTF-8 text ({error})")
    return ModelServerError("internal", f"model '{model}' produced a string output of {outputs} that is not UTF-8, "
                            f"which onnxruntime's Python API returns only as UTF-8 text ({error})")
