"""The design notes of effectfx, written once and cited everywhere as ``Note [Name]``.

Note [Effect tokens]
~~~~~~~~~~~~~~~~~~~~
An *effect key* is a string naming an ordered resource ("ordered", "memory", "stdout", ...).  The effect
registry (``effectfx.effects``) is the one source of truth for which ops are effectful and with which key.
A *token* is an empty tensor (``torch.empty(0)``) standing for "the state of that resource so far".

Calling convention of the functionalized form:
  * an effectful op ``op(*args)`` becomes ``with_effects(token, op, *args) -> (new_token, *outs)``;
  * a graph that has effects takes one token per key it touches and returns the final token of each:
    the root is ``(*tokens, *inputs) -> (*tokens, *outputs)``, a region subgraph is
    ``(*tokens, *operands) -> (*tokens, *outs)``;
  * token positions follow the *sorted* order of the keys, in every graph, so signatures are deterministic;
  * per key, tokens form one linear chain: every token value is consumed at most once.
Effects on different keys are unordered with respect to each other; the default runtime still runs nodes in
capture order, so its effect log equals eager's exactly.

The unlifted form keeps the chain but not the boundary: each graph makes its tokens with ``make_token()``
and keeps its last ones alive with ``sink_tokens([...])``; a call of an effectful region is itself wrapped
as ``with_effects(token, invoke_subgraph, subgraph, identifier, *operands)`` (for a region with several
keys, ``token`` is the tuple of its tokens in sorted key order, and so is element 0 of the result).  The
token-free form drops tokens entirely and relies on node order plus the impurity of effectful nodes; the
captured form already is token-free, which is why efx.compile goes there directly (``discover_effects``).

Note [Region identity]
~~~~~~~~~~~~~~~~~~~~~~
A region (``@effectfx.region``) is traced once per *identity* and then called through
``invoke_subgraph(subgraph, identifier, *operands)``.  The code is the package ``effectfx.regions``:
promotion (``promotion``), the region cache of one capture (``cache``), the effects known per body across
captures (``effects``); and the package ``effectfx.guards``, which guards every compiled program too: the
key (``identity``), what a trace reads (``reads``), labels (``labels``), the guard kinds (``kinds``) and
their one evaluator (``check``), and the words ``efx.explain`` and ``efx.compile`` use for all of them
(``words``); a call site during capture is ``effectfx.hops.region``.  Identity has two halves:

  * the *key* -- what every call shows without running anything: ambient state (grad mode; autocast
    enabled and dtype per device type; whether a profiler is on), the argument structure, every tensor
    argument's metadata (shape, stride, dtype, device, requires_grad), the value of every non-string
    argument, and for modules passed in their structure (submodule classes, parameter/buffer metadata by
    name, and the hooks and instance ``forward`` of every submodule and torch's global hooks: a function
    by its code, the values it closes over and the globals it names, ``hooks``) -- not their attributes;
  * the *guards* -- what the body's trace read, and only that.  During a capture every object reached
    from a body's arguments (modules, submodules, config objects at any depth) is *watched*
    (``effectfx.guards.reads``: its class is swapped for a recording subclass, on the capturing thread,
    until the capture ends), and each attribute read becomes a guard on the value at its path: a value
    for plain data (``self.config.use_gate == True``), a class for objects, absence for a failed ``getattr``.
    Closure cells and the globals a body's code names are guarded the same way; so is the key order of a
    module's ``_parameters``, ``_buffers`` or ``_modules`` a trace read (iterating ``parameters()`` or a
    ``ModuleList``: ``kinds.Keys``).  An attribute no trace reads (``layer_idx`` of a layer that never
    looks at it) never splits bodies.

A call site reuses the first body with its key whose guards hold on its own arguments; checking a guard
is itself a read, so an enclosing body (or the root) depends on it too -- every call site watches the
objects it is passed, also where it reuses a body and no trace ran.  The root's reads are guards of
the compiled program, by identity: ``efx.compile`` checks them before every run and captures anew when one
fails (flip ``model.config.use_gate`` between two calls: eager's result and effects on both).  So are the
hooks and instance ``forward`` of every module the program may run, by identity, with the closure cells and
globals their code names: a hook registered or removed, ``mod.forward = types.MethodType(f, mod)``, or
rebinding a global ``hook_fn`` a hook calls captures anew (``tests/test_rebinding.py``).

*Labels.*  A ``str`` a body reads (an attribute, or a string argument) is handed to it as a ``Label``, a
``str`` that notices any use of its value.  A label only ever passed to effectful ops becomes an operand:
the body gets a placeholder, each call site passes its own string, one body serves every layer of
``record_memory("forward", self.name)``.  Any other use -- comparison, hashing, formatting, slicing, a
method, a non-effect op, a backward formula, being returned, or turning up inside another string the body
bakes in (``"/".join(...)`` reads it in C) -- *specializes*: the value is baked back in and guarded.
A string a forward (pre-)hook of a module the body is passed closes over or has as a default is a label
too (``effectfx.guards.hooks.hook_labels``: ``lambda m, a, o, n=f"attn{i}": record(n)`` on every layer is
one body); its path goes through the module's hook table to the hook's cell or default.  (A backward hook's
strings stay keyed by value.)
Numbers are never labels: CPython reads an int in C (``range(n)``, ``xs[i]``) without calling any of its
methods, so a use could not be seen.

*Promotion.*  Under grad mode, a call whose floating tensor arguments do not all require grad while another
of its tensors does (a parameter) is keyed as if they did: the first layer of a stack, whose input needs no
gradient, shares the body of the others (so does every layer's attention mask).  The body is traced with
those arguments requiring grad, and serves such a call exactly when eager would have run the same ops:
each output requires grad only if its autograd graph reaches an operand that does at this call (walked
over the trace's fake autograd graph, ``TracedGraph.out_deps``), and the call's backward is the body's
without the promoted operands' gradients (``<body>_backward_skip0``: dead code removed, never an effect).
A trace that shows the body could differ is dropped, and that region keys such calls as they are for the
rest of the capture (``efx.explain`` says why): its code reads a tensor's autograd state
(``x.requires_grad``, ``grad_fn``...), its autograd graph holds an ``autograd.Function`` of the code's own
(which may look at ``ctx.needs_input_grad``; a custom op's registered formula is an op), it updates an
operand in place, or its backward has effects -- eager runs a formula only for the gradients it needs.
Every body is checked so when traced, promoted or not (a body first traced for a call whose arguments
needed a gradient may later be asked to serve one whose do not), and a body that looked at autograd state
makes every trace calling it count as looking too.  Code that looks at autograd state (``x.is_leaf``)
also makes whether each tensor argument has a history part of the body's identity, and so does autocast,
which caches its casts of leaves that require grad: under autocast nothing is promoted.

Operands are the tensor arguments, then *lifted* tensors and labels in order of first use: the module's
parameters, buffers and plain tensor attributes by name (so N blocks with different weights share one
subgraph), any other real tensor the body reads (by identity: globals and closed-over constants), and
label strings by their path.  A body may not read an intermediate tensor of its caller that is not an
argument -- a different call would silently see a stale value -- so that is an error.  A bound method
made a region (``layer.forward = efx.region(layer.forward)``) is its function with the module as first
argument, so all instances share bodies.  Identifiers ``subgraph_0, subgraph_1, ...`` are given in order
of first trace within one capture; a body that returns an operand unchanged hands the caller that very
tensor back.

The effects of a body are discovered when it is functionalized: the tokens of every key before and after
the body are compared, and each key whose token changed is an effect of the region.  The set is stored
under the identifier (and, across captures, on the region by cache key: ``effectfx.regions.effects``); the
subgraph is then wrapped to take and return those tokens and every call site threads its current tokens
through it.  Nested regions propagate their keys outwards.
A region whose effect set differs on a later trace of the same identity (state read where no guard sees
it, such as a global of a function the body calls) is an error, not a guess.

Note [Joint trace]
~~~~~~~~~~~~~~~~~~
When outputs require grad, capture runs the forward, then ``torch.autograd.grad`` on the fake outputs,
recording every node with its phase ("forward" or "backward").  The partitioner splits the joint graph by
phase: forward nodes become the forward graph, which additionally returns the forward values backward
nodes read (exactly what eager autograd saves), and backward nodes become the backward graph.  Regions
are traced the same way (recursively), giving each body a forward and a backward subgraph; at the call
site a ``RegionCall`` autograd function emits the forward call, and its ``backward`` emits the backward
call when the enclosing trace runs its backward phase.  Forward effects therefore land in forward graphs
only, and effects raised by autograd formulas land in backward graphs, in the engine's order.  Backward
graphs take their gradients contiguous (``TensorMeta.tangent``), whatever the layout of the output they
belong to: the formula of a caller hands a transposed result's gradient over as it computed it, so a
region's call site and a compiled program's backward make each incoming gradient contiguous first.

A call site is cheap by construction, because a capture has one per layer: a body's forward does not
return the saved values that are its own inputs (the call site hands its operand to the backward call), a
saved value is only a ``getitem`` node at the call site (every site shares one fake per saved slot as its
metadata), the module's parameters it passes are lifted as they are, without fakes (``Scope.lift_real``),
efx.compile simplifies its own capture in place rather than copying it (``passes.simplify``), and a graph's
first runs are interpreted, its code generated only when it runs again (``effectfx.graph.interpreter``): a
root graph with a line per call site costs more to compile than to interpret a few times.

Note [Partial backward]
~~~~~~~~~~~~~~~~~~~~~~~
Eager's engine runs only the autograd formulas reachable from the outputs that got a gradient: the
formulas (and the effects inside them) of an output nothing used never run, and an input only such an
output reaches keeps ``grad is None``.  One backward graph over zero tangents would run them, so the
backward of a traced graph is *per set of outputs that got a gradient*.  Both autograd functions that run
a traced graph -- ``RegionCall`` (a region's call site, during capture) and the one of a compiled training
program (at run time) -- take their gradients unmaterialized; when some are missing they call the
backward for exactly the outputs that got one, which is traced once per set: the code is traced again
(the same arguments, as they were at the call, for the forward may have written one in place since;
the same grad mode and autocast) with ``torch.autograd.grad`` over those outputs only, and
that trace's backward is kept; its forward is dropped.  A body retraced while its caller's backward is
derived (a nested region) runs below ``torch.autograd.grad``, which the label mode dispatched and is not
active in: the retrace enters it again (``LabelMode.entered``), so its labels -- a hook's name too -- are the
operands the first trace made them.  The traces run the same forward, so the values
the new backward reads are found among the saved values of the first by node name (and metadata), and
every node the new forward kept must be the first's, arguments and constants included; a mismatch is an
error, never a guess.  A region's such backward is a subgraph of its own (``<body>_backward_01``: which
outputs, in order), with the body's identifier.  A loaded program cannot trace and refuses with
``PartialBackwardError``.

No new trace is needed when each output without a gradient is *covered*: the autograd graph of an output
that has one reaches its ``grad_fn`` (a model's logits, from the loss computed from them).  The engine then
runs the very same formulas, and the full backward with zero tangents for the covered outputs is autograd's
own (``x + 0`` is ``x``).  A compiled program records, per differentiable output, which others cover it
(``TracedGraph.covered_by``, walked over the fake autograd graph at capture; kept by save/load).  A region
call's node is one node for all its results but not one set of formulas: the walk names it per result,
and through it follows only the operands that result reaches (``TracedGraph.out_deps``), so two results of
one call never cover each other.

Note [Mutations]
~~~~~~~~~~~~~~~~
Graphs are functional: an in-place op is recorded as a functional op whose result is the new value of
what it wrote (``add_`` -> ``add``; ops writing several arguments -> torch's ``*_functional`` variant, their
results then the new values; BatchNorm's ``native_batch_norm`` in training, which updates its running
statistics without saying so in its schema -> ``_native_batch_norm_legit_functional``).  The written tensor
is then *rebound* to that result, so every later read in the graph -- an effect op's argument included --
sees the new value, in eager's order.  ``effectfx.capture.mutation`` says which op records what.

When the written tensor is an input of the graph (an argument, a module's buffer, a lifted tensor):
  * the graph returns its new value after the tensor outputs, as torch.export returns buffers to mutate:
    ``(*tokens, *inputs) -> (*tokens, *outputs, *new values of mutated inputs[, *saved])``; the
    ``TracedGraph.mutated`` / ``Program.mutations`` list the inputs in that order;
  * a region's call site writes the new values into the *caller's* tensors -- the call site's own buffer,
    so one body serves every BatchNorm -- by rebinding them (or an in-place copy the caller's trace
    records, when a view, a dtype or autograd is involved); a caller whose input was written is then
    itself a graph with a mutated input, up to the root;
  * the root's caller (``Program.write_back``) copies the new values into the user's tensors after the
    graph ran, as eager's in-place ops left them -- unless the graph already updated them where they live:
    efx.compile's default backend runs an elementwise (or ``_foreach_``) update of a written input in place
    when nothing reads the old value afterwards and only the new value is a result (``passes.reinplace``),
    so a compiled training step updates parameters and optimizer state as eager's optimizer does.
An input that requires grad is a leaf of the trace's autograd; user code gets a clone with history when the
caller's tensor is not a leaf, so in-place updates of intermediates differentiate as in eager.  Updating a
leaf that requires grad is refused, as eager refuses it; so is updating an operand another operand aliases.

*Containers.*  The tensors inside an argument's lists, dicts and pytree-registered objects (transformers'
caches: ``effectfx.program.containers``) are inputs like any other.  Code that changes such a container --
``xs.append(t)``, ``cache.update(k, v)`` rebinding ``cache.layers[i].keys`` to a longer tensor -- changes a
copy the trace made, so a graph whose code changed top-level arguments' containers returns
``(out, their new states)``: the new tensors are outputs after the others, an unchanged one is the input
handed back.  A region's call site then puts those states into the caller's own containers (so the
caller's later code reads the new tensors), and the root's caller does so after each run
(``Program.finish``), keeping the caller's objects: ``outputs.past_key_values is cache``, as in eager.  A
change that puts anything but tensors and plain values into an argument is refused.

*Python state.*  What the code writes into state it reaches but is not handed -- a module's attributes, a
hook's list, a global dict -- is written again after every call with the call's values, and no fake of a
capture is left there: Note [Python state] (``effectfx.capture.python_state``).

Note [Symbolic shapes]
~~~~~~~~~~~~~~~~~~~~~~
A capture may take some sizes of its arguments as *symbols*: its fake tensors then come from a fake mode with
torch's ``ShapeEnv`` (``torch.fx.experimental.symbolic_shapes``, what torch.compile and torch.export use),
each chosen size a fresh symbol (0 and 1 specialize, with a guard, as in torch), and size arithmetic the code
does in Python (``x.shape[1] * 2``, ``view(b, s, h, d)``, ``torch.arange(s)``) is a ``SymInt`` the graph
records as nodes, not a baked-in number.  The graph is then valid for every call whose sizes satisfy its
*shape guards*: every fact the trace relied on (two sizes equal, a size >= 2, a stride), which the ShapeEnv
produces over the program's tensor arguments (``InputSignature.shape_guards``, checked with its other
signature before a run; kept by save/load).  Which sizes are symbols (``capture.shapes``): ``efx.compile(fn,
dynamic=None)`` captures static first and, when a call misses every program only in sizes, captures once more
with every size of each tensor that changed as a symbol (a padded batch changes its length each step and its
batch size at the last one); ``dynamic=True`` makes every size a symbol from the first call, ``dynamic=False``
none; ``mark_dynamic`` / ``mark_static`` (the marks ``torch._dynamo`` sets) and ``efx.capture(...,
dynamic_shapes=...)`` (torch.export's spec) choose per tensor.  A call whose exact signature has no program
runs a symbolic program whose guards hold, and is remembered for that signature: the next such call is one
lookup.

*Sizes are read, never passed.*  A graph's interface stays what the other Notes say -- tensors, labels and
tokens -- because every graph reads each symbol it needs from a dimension of one of its own tensor inputs
(``aten.sym_size.int(x, d)``; ``graph.symbols.Sizes``, which evaluates an expression with torch's
``sympy_interp`` over those nodes).  A region body's operands have the caller's symbolic metadata, so its
key (Note [Region identity]) holds their *expressions*: one body per distinct layer serves every length,
and it reads ``s`` from its own operands.  A backward graph reads sizes from its saved tensors and
gradients; when none has the one it needs (``sum``'s backward expands to the input's size), the forward
input that has it is saved for it -- never a size.  A body whose operands carry a size only inside a
larger expression (``2*s``) while its code needs ``s`` itself is refused with a ``CaptureError``.

Metadata compare by expression (``TensorMeta``), never by asking a symbol, which would add a guard.  An
op whose fake implementation pins a symbol to the example's value (``constant_pad_nd``'s C++ kernel reads
its sizes as ints) gets one that keeps it symbolic (``capture.fakes``); any other that pins one is named
by ``efx.explain`` ("specialized"), with the shape guards and the symbolic inputs.  A size given to an
effect op (an ``int`` argument) is a node like any other: the effect receives each call's real value.

*Sizes as ints.*  To the captured code a symbolic size is an ``int``: ``isinstance(n, int)`` holds, with no
guard, as under Dynamo (``interposers.sym_numbers``; torch's own code still sees a ``SymInt``);
arithmetic, ``/``, ``math.floor`` / ``ceil`` / ``trunc`` and ``round`` given to tensor ops stay nodes
(``graph.symbols``); what needs the value -- ``range``, ``int()``, ``if``, text, an expression with no
node form such as ``round(n / 3, 2)`` -- gets it with a guard.

Note [Higher-order ops]
~~~~~~~~~~~~~~~~~~~~~~~
A higher-order op (HOP) of effectfx's graphs is a target that runs subgraphs its calling graph holds as
``get_attr`` nodes: ``invoke_subgraph`` (a region call, Note [Region identity]) and the control flow of
Note [Control flow].  Each has three homes, and only three:

  * its run-time callable and its row in the one table ``effectfx.ops.HOPS`` (target -> ``HopSpec``: the
    name graphs print and program files store, the argument its tokens lead, its Note, the module of its
    rules).  Printing, serialization, the rewrites' code generation, the effect walks
    (``effectfx.graph.walk``) and the token passes read the table, never a list of their own;
  * its family's module in ``effectfx.hops`` (``effectfx.hops.region`` for regions): the capture
    rule, installed with ``effectfx.interposers.takeover.take_over(HopClass, rule)`` -- during a capture on
    this thread, a call of torch's HOP runs ``rule(tracer, *args)`` before torch dispatches it; one mechanism
    for every family, and a HOP with no rule is refused by name (``effectfx.capture.unsupported``) -- and its
    autograd rule (an ``autograd.Function`` emitting the forward and backward nodes, ``hops.cond.CondCall``);
  * its Note.
Tokens: a HOP whose row names a token argument follows Note [Control flow]'s convention, whose rules in the
token passes and the verifier are ``effectfx.passes.control_flow`` for all of them; a new convention is a
new rule there, named by the row.  Torch's print HOP is captured as Python ``print`` (``hops.print_hop``):
it leaves no node of its own, so it has no row.

Note [Control flow]
~~~~~~~~~~~~~~~~~~~
``torch.cond``, ``while_loop`` and ``scan`` in captured code are taken over before torch dispatches them
(Note [Higher-order ops]; ``effectfx.hops.cond``, ``effectfx.hops.loops``): each function is traced by the
tracer itself into a subgraph held by the calling graph, and one node runs it at run time, so the predicate
and the trip count are run-time values and only the branch taken runs its effects:

  ``effectfx.ops.cond(pred, true_graph, false_graph, operands) -> (*outs)``
  ``effectfx.ops.while_loop(cond_graph, body_graph, carried, additional) -> (*carried)``
  ``effectfx.ops.scan(combine_graph, init, xs, additional) -> (*carry, *stacked ys)``

A subgraph's inputs are the op's operands, then every tensor of an enclosing graph its function reads,
lifted as extra operands (the subgraphs of one op take the same inputs).  Tokens, as JAX threads them
through its cond and while: let K be the sorted keys any subgraph of the node performs (regions inside
included).  Every subgraph of the node takes and returns the tokens of all of K -- a subgraph with no effect
on a key passes its token through, so the branches share one signature, and a while_loop's condition (which
may not perform effects) takes and hands back the body's tokens -- and the node carries them in front of one
tuple argument and of its results:

  ``cond(pred, t, f, (*tokens, *operands)) -> (*tokens, *outs)``
  ``while_loop(c, b, (*tokens, *carried), additional) -> (*tokens, *carried)``: loop-carried values, whose
  condition graph returns ``(*tokens, pred)`` (the predicate is the last result);
  ``scan(g, (*tokens, *init), xs, additional) -> (*tokens, *carry, *ys)``: part of the carry.

``gm.meta["effectfx_control_flow"]`` holds K on each subgraph through every pass.  The unlifted form wraps
the node as it wraps a region call (``with_effects(token(s), effectfx.ops.cond, ...)``) and each subgraph
makes and sinks its own tokens; the token-free form drops them.

Under autograd, ``cond`` is an autograd node whose backward is a second cond over backward branches; as
eager's cond does, each backward branch recomputes its forward (its effects run again, in backward) and then
gives a gradient for every input that requires grad (zeros where the branch does not use it).  ``while_loop``
and ``scan`` on tensors that require grad are refused: eager's backward reruns the loop body with its
effects (while_loop) or drops the body's effects (scan).

Note [Training step]
~~~~~~~~~~~~~~~~~~~~
A captured function may run a whole training step: ``loss.backward()``, gradient clipping, an optimizer's
``step()`` and ``zero_grad()``, with effects anywhere between (``effectfx.interposers.training_step``).
  * *backward.*  On a capturing thread ``torch.autograd.backward`` (what ``Tensor.backward`` calls) takes
    the gradients of the leaves the backward reaches (or of ``inputs=``) with ``torch.autograd.grad`` --
    so the backward's ops, its region backward bodies and their effects are recorded into the root graph
    in the engine's own order -- and accumulates them as eager's ``AccumulateGrad`` does: ``.grad`` set
    when it is None, added in place otherwise; tensor hooks run as the engine runs them, post-accumulate
    hooks after each accumulation.  There is no joint trace: the step's results need no gradient of their
    own (their graph was its backward's), so the program has no backward.  A leaf the step made itself,
    an argument that requires grad, ``create_graph=True`` and a backward inside a region are refused.
  * *optimizers.*  torch.optim's global step hooks see every optimizer that steps.  Its step runs traced
    with torch.compile's switches (``torch.compiler.is_compiling()``, ``capturable=True``), so that its
    formulas use tensors rather than ``.item()`` of the step count: Adam's bias correction is then computed
    in float32 tensor arithmetic, as under torch.compile, and agrees with eager's Python floats to ~1e-7.
    Parameters and state tensors updated in place are mutated inputs (Note [Mutations]).
  * *Python state.*  What the step leaves in Python state -- each parameter's ``.grad`` (the parameters
    of the modules and optimizers the function is handed or reads from its closure and globals, one
    attribute deep, and every leaf its backward reaches), each stepped optimizer's ``state`` entries
    (made lazily on the first step) -- is fake while tracing.  The trace puts it back as it found it, the
    new values are graph outputs after all others, and ``Program.state_writes`` says where each goes: the
    program writes them after every run (``program.containers.write_state``).
  * *guards.*  The program guards on the state it started from -- each such ``.grad`` by identity (None,
    or the tensor it accumulates into; one it never reads, as after ``zero_grad()`` at the step's start,
    need only be a tensor), each optimizer state entry by identity or absence, every
    hyperparameter in ``param_groups`` by value.  So the first step (no state yet) and the later ones are
    two programs.  A float ``lr`` changed between calls captures once more with it as an input (Note
    [Float inputs], ``effectfx.guards.floats``), then is guarded only as a float: a schedule costs two
    captures; a tensor ``lr`` (updated in place by a scheduler) is an input from the start, and a step
    with one runs torch.optim's multi-tensor formulas (SGD's per-tensor loop would ``.item()`` it).
    Python state the step changes that a program cannot replay --
    a hyperparameter (an LR scheduler stepping inside), non-tensor optimizer state -- is refused.

Note [Random numbers]
~~~~~~~~~~~~~~~~~~~~~
Written out in ``effectfx/interposers/rng.py``.  Random ops draw from eager's global generator in graph order
and are never dropped; what eager does with the generator's state -- ``torch.utils.checkpoint``'s
``preserve_rng_state``, the user's ``fork_rng`` -- is recorded as ``effectfx_rng::get_state`` /
``set_state`` nodes, so a checkpoint's recompute replays the forward's draws and the generator ends every
graph where eager's does.
"""
