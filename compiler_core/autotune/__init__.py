"""The auto-tuner: templates, features, cost model, search, measurement and the tuning log.

Import the submodule you need (for example `compiler_core.autotune.records`); this package
imports nothing itself so that reading a tuning log never pulls in LightGBM or LLVM.
"""
