"""meshrun.analysis.hlo on hand-written HLO text: computations, runs per step through nested while loops
(known and unknown trip counts), conditional branches and unreachable code, and each collective's
bytes, tuple parts, mesh axes and `per_step`. Compiled steps are covered by test_pipeline/test_explain."""

from meshrun.analysis import hlo

MESH = {"data": 2, "tensor": 2}  # partition id = 2 * data + tensor

TEXT = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %v.1 = f32[8]{0} get-tuple-element(%p.1), index=1
  %ar = f32[8]{0} all-reduce(%v.1), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  ROOT %t.1 = (s32[], f32[8]{0}) tuple(%i.1, %ar)
}

%inner_c (p.2: (s32[], f32[8])) -> pred[] {
  %p.2 = (s32[], f32[8]{0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %n.2 = s32[] constant(3)
  ROOT %lt.2 = pred[] compare(%i.2, %n.2), direction=LT
}

%outer (p.3: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.3 = (s32[], f32[8]{0}) parameter(0)
  %w.3 = (s32[], f32[8]{0}) while(%p.3), condition=%inner_c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %i.3 = s32[] get-tuple-element(%w.3), index=0
  %v.3 = f32[8]{0} get-tuple-element(%w.3), index=1
  %cp = f32[8]{0} collective-permute(%v.3), channel_id=2, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}
  ROOT %t.3 = (s32[], f32[8]{0}) tuple(%i.3, %cp)
}

%outer_c (p.4: (s32[], f32[8])) -> pred[] {
  %p.4 = (s32[], f32[8]{0}) parameter(0)
  %i.4 = s32[] get-tuple-element(%p.4), index=0
  %n.4 = s32[] constant(4)
  ROOT %lt.4 = pred[] compare(%i.4, %n.4), direction=LT
}

%branch_0 (a.5: f32[8]) -> f32[16] {
  %a.5 = f32[8]{0} parameter(0)
  ROOT %c.5 = f32[16]{0} concatenate(%a.5, %a.5), dimensions={0}
}

%branch_1 (a.6: f32[8]) -> f32[16] {
  %a.6 = f32[8]{0} parameter(0)
  ROOT %ag = f32[16]{0} all-gather(%a.6), channel_id=3, replica_groups={{0,2},{1,3}}, dimensions={0}
}

%once (p.7: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.7 = (s32[], f32[8]{0}) parameter(0)
  %i.7 = s32[] get-tuple-element(%p.7), index=0
  %v.7 = f32[8]{0} get-tuple-element(%p.7), index=1
  %a2a = f32[8]{0} all-to-all(%v.7), channel_id=4, replica_groups={{0,1},{2,3}}, dimensions={0}
  ROOT %t.7 = (s32[], f32[8]{0}) tuple(%i.7, %a2a)
}

%unused (a.8: f32[8]) -> f32[8] {
  %a.8 = f32[8]{0} parameter(0)
  ROOT %dead = f32[8]{0} all-reduce(%a.8), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
}

ENTRY %main (a.9: f32[8], k.9: s32[]) -> (f32[4], f32[2]) {
  %a.9 = f32[8]{0} parameter(0)
  %k.9 = s32[] parameter(1)
  %z.9 = s32[] constant(0)
  %t.9 = (s32[], f32[8]{0}) tuple(%z.9, %a.9)
  %w.9 = (s32[], f32[8]{0}) while(%t.9), condition=%outer_c, body=%outer, backend_config={"known_trip_count":{"n":"4"}}
  %v.9 = f32[8]{0} get-tuple-element(%w.9), index=1
  %u.9 = (s32[], f32[8]{0}) while(%w.9), condition=%outer_c, body=%once
  %g.9 = f32[16]{0} conditional(%k.9, %v.9, %v.9), branch_computations={%branch_0, %branch_1}
  %h.9 = f32[8]{0} slice(%g.9), slice={[0:8]}
  ROOT %rs = (f32[4]{0}, f32[2]{0}) reduce-scatter(%h.9, %v.9), replica_groups=[2,2]<=[4], dimensions={0}, to_apply=%add
}
"""


def test_computations_split_the_module():
    comps = hlo.computations(TEXT)
    assert list(comps) == [
        "add", "inner", "inner_c", "outer", "outer_c", "branch_0", "branch_1", "once",
        "unused", "main",
    ]  # fmt: skip
    assert "collective-permute" in comps["outer"] and "collective-permute" not in comps["inner"]
    assert comps["main"].splitlines()[0].strip().startswith("%a.9 = f32[8]{0} parameter(0)")


def test_multiplicity_multiplies_nested_trip_counts():
    runs = hlo.multiplicity(TEXT)
    assert runs["main"] == 1
    assert runs["outer"] == 4
    assert runs["inner"] == 4 * 3
    assert runs["inner_c"] == 4 * (3 + 1)  # a loop tests its condition once more than it iterates
    assert runs["once"] == 1  # no known trip count: counted once
    assert runs["outer_c"] == (4 + 1) + (1 + 1)  # condition of both loops
    assert runs["branch_0"] == runs["branch_1"] == 1  # conditional branches count as taken
    assert runs["add"] == 12 + 1  # the inner all-reduce's reduction (12 runs) and the reduce-scatter's
    assert runs["unused"] == 0  # nothing reachable from ENTRY calls it


def test_collectives_per_step_bytes_and_axes():
    got = {(c.op, c.axes): c for c in hlo.collectives(TEXT, MESH)}
    assert set(got) == {
        ("all-reduce", ("tensor",)),
        ("collective-permute", ("data",)),
        ("all-gather", ("data",)),
        ("all-to-all", ("tensor",)),
        ("all-reduce", ("data", "tensor")),
        ("reduce-scatter", ("tensor",)),
    }
    expect = {  # (bytes, parts, in_loop, per_step)
        ("all-reduce", ("tensor",)): (32, 1, True, 12),
        ("collective-permute", ("data",)): (32, 1, True, 4),
        ("all-gather", ("data",)): (64, 1, False, 1),
        ("all-to-all", ("tensor",)): (32, 1, True, 1),
        ("all-reduce", ("data", "tensor")): (32, 1, False, 0),
        ("reduce-scatter", ("tensor",)): (16 + 8, 2, False, 1),  # a tuple counts once, bytes summed
    }
    for key, (nbytes, parts, in_loop, per_step) in expect.items():
        c = got[key]
        assert (c.bytes, c.parts, c.in_loop, c.per_step) == (nbytes, parts, in_loop, per_step), key


def test_without_entry_uncalled_computations_run_once():
    text = "%inner" + TEXT.split("%inner", 1)[1].split("%outer_c", 1)[0]  # 3 computations
    runs = hlo.multiplicity(text)
    assert runs == {"inner": 3, "inner_c": 4, "outer": 1}
    per_step = {c.op: c.per_step for c in hlo.collectives(text, MESH)}
    assert per_step == {"all-reduce": 3, "collective-permute": 1}
