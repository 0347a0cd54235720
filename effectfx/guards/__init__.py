"""Guards (Note [Region identity]): what a trace relied on of the Python state it read, checked before a
program serves another call -- a region's body at another call site, a compiled program at its next call
(with or without regions).

:mod:`.reads` records what a trace reads (watching objects, labels for strings: :mod:`.labels`) as guards;
:mod:`.kinds` holds the guard kinds, :mod:`.values` what they hold of values (plain data by value, objects
by identity, paths); :mod:`.check` is the one evaluator (interpreted, or compiled to :mod:`.emit`'s C++
tree and Python code); :mod:`.identity` is the key a call is matched by before its guards, :mod:`.hooks`
the module hooks in both, :mod:`.words` what ``efx.explain`` and ``efx.compile`` say about them.

Adding a guard kind is one frozen dataclass in :mod:`.kinds` deriving from ``Guard`` -- its fields after
``path``, ``holds(value)``, ``describe()``, and, where a compiled program can check it without the
interpretation, ``tree_check`` or ``python_check`` -- made where a trace records it (``kinds.guard_on``,
or the caller of a recorder), plus its case in ``KIND_CASES`` of ``tests/test_guard_code.py``: the value
it holds on, a change that breaks it, its words, and where a compiled check puts it.  Nothing else reads
a guard's fields: the evaluator, the recorders and the words ask the guard.
"""
