"""Passes over Programs: each a named ``Program -> Program`` function with a one-line contract, run by
``pipeline.run_passes`` (which stamps name and time into ``prog.history`` and, under ``EFFECTFX_DEBUG=1``,
verifies after each).  None mutates its input but ``simplify_in_place``, which efx.compile runs on
the capture it alone holds.  See Note [Effect tokens] for the forms.

=============================================  ============================================================
``thread_tokens.thread_tokens``                captured -> functionalized (tokens threaded, effects found)
``thread_tokens.discover_effects``             captured -> token-free, region effects found, no rebuild
``unlift.unlift_tokens``                       functionalized -> unlifted (make_token / sink_tokens)
``remove_tokens.remove_effect_tokens``         functionalized/unlifted -> token-free
``dce.dead_code_elimination_pass``             any -> same form, pure dead nodes gone, effects kept
``simplify.simplify_for_runtime``              token-free -> token-free, autograd-only calls gone
``simplify.simplify_in_place``                 the same, on a program nobody else holds (efx.compile's)
``direct_calls.direct_op_calls``               token-free -> token-free, operators called directly
``verify.verify``                              checks the invariants; returns nothing, raises on violation
``backends.inductor.lower_to_inductor``        token-free -> Inductor-compiled segments between effects
=============================================  ============================================================
"""
