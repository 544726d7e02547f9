"""The CUDA libraries onnxruntime-gpu's CUDA provider loads: loading them from NVIDIA's wheels with no
LD_LIBRARY_PATH (``preload_cuda``), their versions, and whether the CUDA provider can run here
(``ort_cuda_status``)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from . import gpu


# The libraries onnxruntime-gpu's CUDA provider loads (1.31.1 is built against CUDA 13) and, for each, a C entry
# point that returns its version without a GPU context. NVIDIA's pip wheels (nvidia-*-cu13, which PyTorch cu130
# installs) ship them under site-packages/nvidia/*/lib.
CUDA_LIBRARIES = {
    "cudart": ("libcudart.so.13", "cudaRuntimeGetVersion"),
    "cublas": ("libcublas.so.13", "cublasGetProperty"),
    "cublasLt": ("libcublasLt.so.13", "cublasLtGetVersion"),
    "curand": ("libcurand.so.10", "curandGetVersion"),
    "cudnn": ("libcudnn.so.9", "cudnnGetVersion"),
}


def nvidia_lib_dirs() -> list[str]:
    """``site-packages/nvidia/*/lib`` folders of the installed NVIDIA wheels (what LD_LIBRARY_PATH needs for
    onnxruntime-gpu when no system CUDA toolkit is installed)."""
    import site
    import sys
    roots = [Path(p) for p in (*sys.path, *site.getsitepackages()) if p]
    seen: list[str] = []
    for root in roots:
        for lib in sorted((root / "nvidia").glob("*/lib")) if (root / "nvidia").is_dir() else []:
            if str(lib) not in seen:
                seen.append(str(lib))
    return seen


_PRELOADED: dict | None = None


def preload_cuda(ort_module=None, lib_dirs: Callable[[], list[str]] | None = None,
                 load: Callable[[str], object] | None = None) -> dict:
    """Make the CUDA/cuDNN libraries of NVIDIA's wheels loadable for onnxruntime-gpu's CUDA provider, with no
    LD_LIBRARY_PATH: ORT's own ``onnxruntime.preload_dlls()`` (it loads them from the site-packages holding
    onnxruntime), then each library in :data:`CUDA_LIBRARIES` still missing from another ``nvidia/*/lib`` folder
    (:func:`nvidia_lib_dirs`: e.g. PyTorch's wheels in another site-packages). A library loaded by full path
    satisfies a later dlopen of its soname. Once per process; returns what it did (``forge doctor`` shows it)."""
    global _PRELOADED
    if _PRELOADED is not None and ort_module is None:
        return _PRELOADED
    import ctypes
    import io
    load = load or (lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
    res: dict = {"ort_preload_dlls": None, "loaded": {}}
    try:
        ort = ort_module
        if ort is None:
            import onnxruntime as ort
        if hasattr(ort, "preload_dlls") and "CUDAExecutionProvider" in ort.get_available_providers():
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):      # it prints each library it could not load
                ort.preload_dlls(cuda=True, cudnn=True)
            res["ort_preload_dlls"] = buf.getvalue().strip() or "ok"
    except Exception as e:  # noqa: BLE001 - what failed is reported, the fallback below still runs
        res["ort_preload_dlls"] = f"failed: {e}"
    dirs = (lib_dirs or nvidia_lib_dirs)()
    for name, (soname, _) in CUDA_LIBRARIES.items():
        where = _loaded_path(soname)
        if where is None:
            for d in dirs:
                f = Path(d) / soname
                if f.is_file():
                    try:
                        load(str(f))
                        where = str(f)
                        break
                    except OSError:
                        continue
        res["loaded"][name] = where
    if ort_module is None:
        _PRELOADED = res
    return res


def _loaded_path(soname: str) -> str | None:
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if line.rstrip().endswith("/" + soname) or f"/{soname}" in line:
                return line.split()[-1]
    except OSError:
        pass
    return None


def _cuda_version_int(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def cuda_library_versions() -> dict[str, dict]:
    """Each CUDA library onnxruntime-gpu needs: found (dlopen by soname, which finds what preload_cuda loaded), its
    path and version."""
    import ctypes
    out: dict[str, dict] = {}
    for name, (soname, fn) in CUDA_LIBRARIES.items():
        try:
            lib = ctypes.CDLL(soname)
        except OSError as e:
            out[name] = {"soname": soname, "found": False, "error": str(e).split(":")[-1].strip()}
            continue
        info: dict = {"soname": soname, "found": True, "path": _loaded_path(soname)}
        try:
            if name == "cublas":        # cublasGetProperty(MAJOR_VERSION=0 / MINOR=1 / PATCH=2, int*)
                parts = []
                for prop in (0, 1, 2):
                    v = ctypes.c_int()
                    lib.cublasGetProperty(prop, ctypes.byref(v))
                    parts.append(str(v.value))
                info["version"] = ".".join(parts)
            elif name in ("cublasLt", "cudnn"):   # size_t fn(void): e.g. 130100 / 91000
                getattr(lib, fn).restype = ctypes.c_size_t
                v = int(getattr(lib, fn)())
                info["version"] = (f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if name == "cublasLt"
                                   else f"{v // 10000}.{(v % 10000) // 100}.{v % 100}" if v >= 10000
                                   else f"{v // 1000}.{(v % 1000) // 100}.{v % 100}")
            else:                       # int fn(int*): cudart 13000 -> 13.0; curand 10400 -> 10.4.0
                v = ctypes.c_int()
                getattr(lib, fn)(ctypes.byref(v))
                info["version"] = _cuda_version_int(v.value) if name == "cudart" else \
                    f"{v.value // 1000}.{(v.value % 1000) // 100}.{v.value % 100}"
        except (AttributeError, OSError) as e:
            info["version"] = None
            info["error"] = str(e)
        out[name] = info
    return out


def ort_cuda_status() -> dict:
    """Whether onnxruntime here can run the CUDA provider: its version and build, the providers it offers, the
    CUDA libraries it would load, and (``problem``) why not when it cannot."""
    try:
        import onnxruntime as ort
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        return {"onnxruntime": None, "providers": [], "cuda_provider": False,
                "problem": f"onnxruntime cannot be imported ({e})"}
    providers = list(ort.get_available_providers())
    st = {"onnxruntime": ort.__version__, "module": str(Path(ort.__file__).parent),
          "build_info": getattr(ort, "get_build_info", lambda: None)(), "device": ort.get_device(),
          "providers": providers, "cuda_provider": "CUDAExecutionProvider" in providers, "problem": None}
    if not st["cuda_provider"]:
        st["problem"] = ("this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu built for this "
                         "machine's CUDA; the CPU wheel and the GPU wheel both provide the `onnxruntime` module)")
        return st
    st["preloaded"] = preload_cuda()
    st["libraries"] = libs = cuda_library_versions()
    missing = [v["soname"] for v in libs.values() if not v["found"] and v["soname"] != "libcudnn.so.9"]
    if missing:
        st["problem"] = (f"CUDAExecutionProvider cannot load {', '.join(missing)}: no NVIDIA wheel here ships them "
                         "(nvidia/*/lib folders found: " + (":".join(nvidia_lib_dirs()) or "none") + "); "
                         "`python -m pipeline.gpu_setup install` installs them")
    elif gpu.cuda_device() is None:
        st["problem"] = "no CUDA GPU visible"
    else:
        st["session_providers"] = used = _cuda_session_probe()
        if "CUDAExecutionProvider" not in used:
            st["problem"] = f"a session asked for CUDAExecutionProvider got only {used} (see ORT's log above)"
    return st


def _cuda_session_probe() -> list[str]:
    """Providers a one-node session actually got when CUDA was asked for (ORT falls back to CPU with a log line
    when the CUDA provider library cannot load)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    try:
        s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return list(s.get_providers())
    except Exception as e:  # noqa: BLE001
        return [f"error: {e}"]

