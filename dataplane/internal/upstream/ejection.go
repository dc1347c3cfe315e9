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
	in, _ := inRotation(states, now, maxPercent, panicPercent)
	return in
}

// inRotation is InRotationPanic, also reporting whether the panic
// threshold was passed.
func inRotation(states []*State, now time.Time, maxPercent, panicPercent int) (in []bool, panicked bool) {
	in = make([]bool, len(states))
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
		return in, true
	}
	// At least one may be out, never all of them.
	allowed := min(max(1, int(math.Floor(float64(maxPercent)*float64(len(states))/100))), len(states)-1)
	if len(out) <= allowed {
		return in, false
	}
	// Return the ones whose ejection ends first.
	slices.SortStableFunc(out, func(a, b int) int {
		return states[a].Health.EjectedUntil().Compare(states[b].Health.EjectedUntil())
	})
	for _, i := range out[:len(out)-allowed] {
		in[i] = true
	}
	return in, false
}

// Standing is where a deployment stands in one request's order of
// candidates (Standings).
type Standing uint8

// Standings, best first.
const (
	// Healthy: in rotation.
	Healthy Standing = iota
	// Probe: half-open (its timed ejection or parking ended and nothing
	// succeeded since); the attempt that picks it takes its probe
	// (Health.TryProbe), one at a time.
	Probe
	// Panic: out, but routed to as healthy past the panic threshold.
	Panic
	// Capped: ejected, failing its health check or probing, kept in
	// rotation by the maximum ejection percentage: a last resort, after
	// every healthy candidate, the soonest back first.
	Capped
	// CappedParked: parked by a Retry-After and kept in by the maximum
	// ejection percentage: chosen only when nothing else can take the
	// attempt.
	CappedParked
	// Excluded: out of rotation for this request.
	Excluded
)

// Rank orders standings: 0 for the healthy ones (Healthy, Probe, Panic:
// ordered among themselves by weight and affinity), then Capped, then
// CappedParked; Excluded last (never routed to).
func (s Standing) Rank() int {
	switch s {
	case Healthy, Probe, Panic:
		return 0
	case Capped:
		return 1
	case CappedParked:
		return 2
	}
	return 3
}

// Label names the standing of an attempt's deployment at its pick in
// sluice_proxy_upstream_attempts_total{state}: healthy, probe, panic,
// ejected, health_check, probing (a half-open deployment whose probe is
// in flight), parked.
func (s Standing) Label(h *Health, now time.Time) string {
	switch s {
	case Healthy:
		return "healthy"
	case Probe:
		return "probe"
	case Panic:
		return "panic"
	case CappedParked:
		return OutParked
	}
	if reason, _, out := h.Out(now); out {
		return reason
	}
	return "probing"
}

// Standings places each deployment of a pool (their states, in order)
// for a request at now: the ones InRotationPanic leaves out are
// Excluded; of the rest, those ejected, parked or failing their health
// check are a last resort (Capped, CappedParked) unless the panic
// threshold was passed (Panic); a half-open one is a Probe.
func Standings(states []*State, now time.Time, maxPercent, panicPercent int) []Standing {
	in, panicked := inRotation(states, now, maxPercent, panicPercent)
	out := make([]Standing, len(states))
	for i, st := range states {
		h := &st.Health
		switch {
		case !in[i]:
			out[i] = Excluded
		case !h.Ejected(now):
			if h.HalfOpen(now) {
				out[i] = Probe
			} else {
				out[i] = Healthy
			}
		case panicked:
			out[i] = Panic
		case h.parkedNow(now):
			out[i] = CappedParked
		default:
			out[i] = Capped
		}
	}
	return out
}
