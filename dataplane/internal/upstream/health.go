// Package upstream holds the data plane's runtime state of each
// deployment, one type per concern: Slots (this instance's in-flight
// count, the cheap check of max_concurrency in front of the fleet-wide
// lease), Health (passive ejection and Retry-After parking), the
// credential-error log de-duplication, and the HTTP transport that reaches
// the engines. Routing reads it (is a deployment ejected?), forwarding
// writes it (an attempt's outcome); it knows nothing of requests.
package upstream

import (
	"sync"
	"sync/atomic"
	"time"
)

// Passive health (SPEC §7.3): consecutive connect failures or 5xx answers
// eject a deployment with exponential backoff; a 429/503 with Retry-After
// parks it for that long, capped. When every candidate of a pool is
// ejected the pool is used anyway (a pool is never emptied by ejections;
// see routing).
const (
	EjectAfterFailures = 3
	EjectBase          = time.Second
	EjectMax           = 30 * time.Second
	// ParkMax is the default cap of a Retry-After parking, whatever the
	// engine asks.
	ParkMax = 60 * time.Second
)

// Health is the passive health of one deployment.
type Health struct {
	ejectedUntil atomic.Int64 // unix nanoseconds; 0: healthy
	// activeDown is set while the active health check finds the engine
	// down (Checker).
	activeDown atomic.Bool
	// parked is set when the last time out came from a Retry-After
	// (Park), cleared by an ejection for failures: the reason the fleet
	// view shows.
	parked atomic.Bool
	// halfOpen is set by a timed ejection or parking: from its end until
	// an attempt succeeds the deployment is half-open, taking one probe
	// request at a time (probing set while it runs); a failure of the
	// probe ejects it again at once with the next backoff.
	halfOpen atomic.Bool
	probing  atomic.Bool
	// Probation is the deployment's stream probation: an ejection puts
	// it back on probation.
	Probation Probation

	mu       sync.Mutex
	failures int
	backoff  time.Duration
}

// Ejected reports whether the deployment is ejected or parked at now, or
// half-open with its probe in flight (out until the probe answers).
func (h *Health) Ejected(now time.Time) bool {
	return h.activeDown.Load() || h.ejectedUntil.Load() > now.UnixNano() || (h.halfOpen.Load() && h.probing.Load())
}

// HalfOpen reports whether the deployment's timed ejection or parking
// ended at now and no attempt succeeded since: the next attempt is a
// probe (TryProbe).
func (h *Health) HalfOpen(now time.Time) bool {
	return h.halfOpen.Load() && !h.activeDown.Load() && h.ejectedUntil.Load() <= now.UnixNano()
}

// TryProbe takes the probe of a half-open deployment: false when another
// attempt holds it. The attempt releases it with EndProbe whatever its
// outcome (a success closes the deployment, a failure ejects it again).
func (h *Health) TryProbe() bool { return h.probing.CompareAndSwap(false, true) }

// EndProbe releases the probe TryProbe took. An attempt that neither
// succeeded nor failed (a 4xx, the client leaving, a TTFT deadline)
// leaves the deployment half-open for the next probe.
func (h *Health) EndProbe() { h.probing.Store(false) }

// ActiveDown reports whether the active health check finds it down.
func (h *Health) ActiveDown() bool { return h.activeDown.Load() }

// Succeeded resets the failure count and the backoff, and closes a
// half-open deployment (a success of an attempt that started before a
// timed ejection still running says nothing of its end: the deployment
// stays half-open for its return).
func (h *Health) Succeeded() {
	h.mu.Lock()
	h.failures, h.backoff = 0, 0
	if now := time.Now().UnixNano(); h.ejectedUntil.Load() <= now {
		h.halfOpen.Store(false)
		if h.ejectedUntil.Load() > now {
			h.halfOpen.Store(true) // parked meanwhile (Park takes no lock)
		}
	}
	h.mu.Unlock()
}

// Failed counts a connect failure or 5xx; it returns the ejection time
// when this failure ejects the deployment (EjectBase doubling up to
// EjectMax).
func (h *Health) Failed(now time.Time) time.Duration {
	return h.FailedBackoff(now, EjectBase, EjectMax)
}

// FailedBackoff is Failed with the ejection backoff of the deployment's
// model group: base for the first ejection, doubling up to maxBackoff
// while it keeps failing (a zero argument takes the default). A failure
// while a timed ejection runs is not counted (the attempt started before
// it: the ejection accounts for it already); one failure of a half-open
// deployment ejects it again.
func (h *Health) FailedBackoff(now time.Time, base, maxBackoff time.Duration) time.Duration {
	return h.failed(now, base, maxBackoff, false)
}

// CutBackoff counts a stream cut after bytes reached the client, which
// cannot be retried. With others set (other attempts of this instance
// are streaming from the deployment: they are likely cut too, and
// nothing new should start there meanwhile) it ejects at once, like the
// EjectAfterFailures-th failure; otherwise it counts as FailedBackoff.
func (h *Health) CutBackoff(now time.Time, base, maxBackoff time.Duration, others bool) time.Duration {
	return h.failed(now, base, maxBackoff, others)
}

func (h *Health) failed(now time.Time, base, maxBackoff time.Duration, force bool) time.Duration {
	if base <= 0 {
		base = EjectBase
	}
	if maxBackoff <= 0 {
		maxBackoff = max(EjectMax, base)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ejectedUntil.Load() > now.UnixNano() && !h.parked.Load() {
		return 0
	}
	h.failures++
	if h.failures < EjectAfterFailures && !h.HalfOpen(now) && !force {
		return 0
	}
	h.failures = 0
	switch {
	case h.backoff == 0:
		h.backoff = min(base, maxBackoff)
	default:
		h.backoff = min(2*h.backoff, maxBackoff)
	}
	h.ejectedUntil.Store(now.Add(h.backoff).UnixNano())
	h.parked.Store(false)
	h.halfOpen.Store(true)
	h.Probation.Revoke()
	return h.backoff
}

// Park takes the deployment out for d (the caller caps it: ParkMax by
// default, --park-max), as its
// Retry-After asked.
func (h *Health) Park(now time.Time, d time.Duration) time.Duration {
	until := now.Add(d).UnixNano()
	for {
		cur := h.ejectedUntil.Load()
		if cur >= until {
			return d
		}
		if h.ejectedUntil.CompareAndSwap(cur, until) {
			h.parked.Store(true)
			h.halfOpen.Store(true)
			return d
		}
	}
}

// parkedNow reports whether the deployment is out at now by a
// Retry-After parking (not a failure ejection or its health check).
func (h *Health) parkedNow(now time.Time) bool {
	reason, _, out := h.Out(now)
	return out && reason == OutParked
}

// Out reasons (the fleet view, metrics).
const (
	OutEjected     = "ejected"
	OutParked      = "parked"
	OutHealthCheck = "health_check"
)

// Out reports whether the deployment is out of rotation at now, why
// (OutEjected, OutParked, OutHealthCheck) and until when (zero for
// OutHealthCheck: until a probe passes).
func (h *Health) Out(now time.Time) (reason string, until time.Time, out bool) {
	if h.activeDown.Load() {
		return OutHealthCheck, time.Time{}, true
	}
	v := h.ejectedUntil.Load()
	if v <= now.UnixNano() {
		return "", time.Time{}, false
	}
	if h.parked.Load() {
		return OutParked, time.Unix(0, v), true
	}
	return OutEjected, time.Unix(0, v), true
}
