"""Kiln's runtime server: the Open Inference Protocol (KServe v2 REST) over module archives.

`create_app` (runtime_server.app) builds the FastAPI app; `python -m runtime_server` serves it.
Of the compiler it imports only `compiler_core.runtime`, so it needs neither LLVM nor LightGBM.
"""
