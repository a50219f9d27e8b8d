"""The bottom of the stack: compiled-routine building, CPU memory, dtypes and binding, process helpers."""
