"""Facts about this machine and environment, each defined once, one module per subject.

The ground floor: these modules import nothing from stages, targets or the CLI. Cache keys, manifests, reports
and ``forge doctor`` read them so they always agree:

- ``paths``: where forge keeps its files (``forge_home``, ``cache_root``, ``history_db``, ``remote_cache_url``) and
  which commit of forge runs (``source_commit``)
- ``cpu``: what of the CPU changes numbers (``cpu_model``, ``cpu_flags``, ``cpu_isa_class``, ``cpu_facts``)
- ``gpu``: which GPUs there are (``gpus``, ``gpu_sm``, ``cuda_device``), through NVML (``nvml_call``, ``nvml_sm``)
- ``cuda``: the CUDA libraries onnxruntime-gpu loads (``preload_cuda``, ``ort_cuda_status``)
- ``tools``: which tool versions are installed (``TOOLS``, ``tool_version``)
- ``files``: free disk space (``free_bytes``) and publishing a file or directory without a reader ever seeing half
  of it (``atomic_write``, ``publish_dir``)
- ``rss``: how much memory a piece of work peaked at (``PeakRss``, ``process_peak_rss_bytes``)
"""
