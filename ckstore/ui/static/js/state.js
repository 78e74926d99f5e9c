// What every view shares: the overview (all snapshots as columns), filters, the selection.

export const state = {
  ov: null,          // /api/overview
  forks: [],         // /api/forks edges {from, to, shared, sampled}
  tagsAt: new Map(), // position -> [tag names]
  runFilter: null,   // Set of run positions shown (null: all)
  tagFilter: "",     // a tag name: its run and the runs forked from it
  selected: -1,      // position shown in the details panel
  a: -1, b: -1,      // positions picked for comparison
  drop: new Set(),   // positions a gc preview would drop
  flags: new Map(),  // position -> "nan" | "stale" (what each take recorded, from the index)
  listeners: [],
};

export function setOverview(ov) {
  state.ov = ov;
  state.flags = new Map();
  ov.snaps.id.forEach((_, i) => {
    if (ov.snaps.nonfinite[i] || ov.snaps.diverged[i]) state.flags.set(i, "nan");
    else if (ov.snaps.stale[i]) state.flags.set(i, "stale");
  });
  state.tagsAt = new Map();
  for (const [name, pos] of Object.entries(ov.tags)) {
    if (!state.tagsAt.has(pos)) state.tagsAt.set(pos, []);
    state.tagsAt.get(pos).push(name);
  }
  if (state.selected >= ov.snaps.id.length) state.selected = -1;
}

export function ref(pos) {
  const s = state.ov.snaps;
  if (s.name[pos]) return s.name[pos];
  const run = state.ov.runs[s.run[pos]];
  return s.step[pos] === null ? `${run} (${s.id[pos].slice(0, 12)})` : `${run}@${s.step[pos]}`;
}

export function positionOf(id) { return state.ov.snaps.id.indexOf(id); }

// Runs shown: the run filter, narrowed by the tag filter to the tag's run and its forks.
export function visibleRuns() {
  const n = state.ov.runs.length;
  let runs = new Set(state.runFilter ? state.runFilter : [...Array(n).keys()]);
  if (state.tagFilter && state.tagFilter in state.ov.tags) {
    const start = state.ov.snaps.run[state.ov.tags[state.tagFilter]];
    const family = new Set([start]);
    let grew = true;
    while (grew) {
      grew = false;
      for (const e of state.forks) {
        const from = state.ov.snaps.run[e.from], to = state.ov.snaps.run[e.to];
        if (family.has(from) && !family.has(to)) { family.add(to); grew = true; }
      }
    }
    runs = new Set([...runs].filter((r) => family.has(r)));
  }
  return runs;
}

export function onChange(fn) { state.listeners.push(fn); }
export function changed(what) { for (const fn of state.listeners) fn(what); }
