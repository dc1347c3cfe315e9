package upstream

import (
	"math"
	"slices"
	"time"
)

// DefaultMaxEjectionPercent bounds the share of a pool that ejections and
// parkings take out at once (Envoy's max_ejection_percent).
const DefaultMaxEjectionPercent = 50

// EjectedUntil returns the end of the deployment's ejection or parking
// (zero time when it is healthy).
func (h *Health) EjectedUntil() time.Time {
	if h.activeDown.Load() {
		// Down until a probe succeeds: after every timed ejection.
		return time.Unix(0, 1<<62)
	}
	if v := h.ejectedUntil.Load(); v > 0 {
		return time.Unix(0, v)
	}
	return time.Time{}
}

// InRotation says which deployments of a pool (their states, in order) to
// route to at now: the healthy ones, and, when more than maxPercent of
// the pool is ejected or parked, the ejected ones closest to their return
// until at most maxPercent (at least one, never all) are out: ejections
// never empty a pool.
func InRotation(states []*State, now time.Time, maxPercent int) []bool {
	return InRotationPanic(states, now, maxPercent, 0)
}

// InRotationPanic is InRotation with a panic threshold (Envoy's
// healthy_panic_threshold, inverted to the share out): when more than
// panicPercent of the pool is ejected, parked or failing its health
// check, every deployment is routed to as if healthy, because the
// healthy rest would be overwhelmed by the whole load. 0 turns it off.
func InRotationPanic(states []*State, now time.Time, maxPercent, panicPercent int) []bool {
	in := make([]bool, len(states))
	var out []int
	for i, st := range states {
		if st.Health.Ejected(now) {
			out = append(out, i)
		} else {
			in[i] = true
		}
	}
	if panicPercent > 0 && len(out)*100 > panicPercent*len(states) {
		for i := range in {
			in[i] = true
		}
		return in
	}
	// At least one may be out, never all of them.
	allowed := min(max(1, int(math.Floor(float64(maxPercent)*float64(len(states))/100))), len(states)-1)
	if len(out) <= allowed {
		return in
	}
	// Return the ones whose ejection ends first.
	slices.SortStableFunc(out, func(a, b int) int {
		return states[a].Health.EjectedUntil().Compare(states[b].Health.EjectedUntil())
	})
	for _, i := range out[:len(out)-allowed] {
		in[i] = true
	}
	return in
}
