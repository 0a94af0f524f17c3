"""Kiln's compiler: `compile(model, target, shapes, tuning)` -> module archive; run it with
`compiler_core.runtime.load(archive).run(inputs)`."""


def compile(  # noqa: A001 - the entry point
    model, target="llvm", shapes=None, tuning=None, batch_buckets=None
):
    from compiler_core.compiler import compile as _compile

    return _compile(model, target=target, shapes=shapes, tuning=tuning, batch_buckets=batch_buckets)
