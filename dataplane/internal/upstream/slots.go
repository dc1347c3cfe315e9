package upstream

import "sync/atomic"

// Slots counts this instance's requests at a deployment: a cheap
// per-instance check of max_concurrency in front of the fleet-wide lease
// in Redis (docs/proxy.md, docs/limits.md).
type Slots struct{ inFlight atomic.Int64 }

// TryAcquire takes a slot (max 0: no cap).
func (s *Slots) TryAcquire(max int64) bool {
	if n := s.inFlight.Add(1); max > 0 && n > max {
		s.inFlight.Add(-1)
		return false
	}
	return true
}

// Release returns a slot TryAcquire took.
func (s *Slots) Release() { s.inFlight.Add(-1) }

// InFlight is this instance's count of requests at the deployment.
func (s *Slots) InFlight() int64 { return s.inFlight.Load() }
