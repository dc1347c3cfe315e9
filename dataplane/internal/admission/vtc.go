package admission

// vtc.go: fairness between teams within a class (docs/traffic.md,
// "Fairness within a class"), after the virtual token counter of Sheng et
// al., "Fairness in Serving Large Language Models" (OSDI 2024).
//
// Each model group and class keeps a counter of the token cost served per
// team on this proxy. A request's cost is counted when it takes a slot
// (its estimated prompt, InputWeight per token) and corrected when it
// settles (the engine's prompt and completion tokens, OutputWeight per
// completion token). When a slot frees, the waiter that goes first is the
// earliest of the backlogged team with the least counter. A team that
// becomes backlogged (its first waiter) is lifted to the least counter of
// the teams already backlogged, or, when none is, to the counter of the
// team served last: a team idle for a while cannot claim the service it
// did not ask for, and a new team does not start at 0 and starve the
// others until it catches up.
//
// The counters are per proxy: each proxy orders its own waiters. With n
// proxies behind a load balancer that spreads every team's requests, the
// served cost of backlogged teams evens out on each proxy and so overall;
// a team whose requests all land on one proxy competes only there.

import configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"

// Cost weights (tokens). A completion token costs more engine time than a
// prompt token (one decode step each, against a share of a prefill
// chunk); 1 and 2 are the VTC paper's weights.
const (
	InputWeight  = 1
	OutputWeight = 2
)

// Cost is the weighted token cost of prompt and completion tokens.
func Cost(prompt, completion int64) float64 {
	return float64(prompt)*InputWeight + float64(completion)*OutputWeight
}

// maxTeams bounds a counter map: past it, teams without waiters whose
// counter is at most the lift base are dropped (lossless: a returning team
// would be lifted to the base anyway).
const maxTeams = 4096

// vtc is one model group's and class's virtual token counters. Its
// methods run under Queues.mu.
type vtc struct {
	counters map[string]float64
	// last is the counter of the team last admitted from the queue.
	last float64
	// next caches head's answer until the waiters or counters change.
	next  *waiter
	valid bool
}

func (v *vtc) changed() { v.valid = false }

// base is the counter a team becoming backlogged is lifted to: the least
// counter among backlogged teams other than team, else last.
func (v *vtc) base(waiting []*waiter, team string) float64 {
	b, found := 0.0, false
	for _, w := range waiting {
		if w.team == team {
			continue
		}
		if c := v.counters[w.team]; !found || c < b {
			b, found = c, true
		}
	}
	if !found {
		return v.last
	}
	return b
}

func backlogged(waiting []*waiter, team string) bool {
	for _, w := range waiting {
		if w.team == team {
			return true
		}
	}
	return false
}

// lift raises team's counter to the base.
func (v *vtc) lift(waiting []*waiter, team string) {
	if v.counters == nil {
		v.counters = map[string]float64{}
	}
	if b := v.base(waiting, team); v.counters[team] < b {
		v.counters[team] = b
	}
	v.changed()
}

// arrive is a waiter of team about to join waiting: a team becoming
// backlogged is lifted.
func (v *vtc) arrive(waiting []*waiter, team string) {
	if !backlogged(waiting, team) {
		v.lift(waiting, team)
	}
	v.changed()
}

// served records that a waiter of team took a slot from the queue.
func (v *vtc) served(team string) {
	v.last = v.counters[team]
}

// charge adds cost (negative: a correction) to team's counter; a team
// seen for the first time starts at the base.
func (v *vtc) charge(waiting []*waiter, team string, cost float64) {
	if _, ok := v.counters[team]; !ok {
		v.lift(waiting, team)
		v.prune(waiting)
	}
	v.counters[team] += cost
	v.changed()
}

func (v *vtc) prune(waiting []*waiter) {
	if len(v.counters) <= maxTeams {
		return
	}
	b := v.base(waiting, "")
	for team, c := range v.counters {
		if c <= b && !backlogged(waiting, team) {
			delete(v.counters, team)
		}
	}
}

// head is the waiter to try next: the earliest waiter of the backlogged
// team with the least counter (ties: the earliest waiter). waiting is in
// arrival order.
func (v *vtc) head(waiting []*waiter) *waiter {
	if v.valid {
		return v.next
	}
	var best *waiter
	bc := 0.0
	for _, w := range waiting {
		if c := v.counters[w.team]; best == nil || c < bc {
			best, bc = w, c
		}
	}
	v.next, v.valid = best, true
	return best
}

// Charge counts cost (Cost; negative to correct an estimate) as served to
// team in class c of group: when the request takes a slot (its estimate)
// and when it settles (the difference to its real cost).
func (q *Queues) Charge(group string, c configv1.TrafficClass, team string, cost float64) {
	if cost == 0 {
		return
	}
	r := rank(c)
	q.mu.Lock()
	g := q.group(group)
	g.vtc[r].charge(g.waiting[r], team, cost)
	q.mu.Unlock()
}

// Served returns team's counter in class c of group (tests, inspection).
func (q *Queues) Served(group string, c configv1.TrafficClass, team string) float64 {
	q.mu.Lock()
	defer q.mu.Unlock()
	if g := q.groups[group]; g != nil {
		return g.vtc[rank(c)].counters[team]
	}
	return 0
}
