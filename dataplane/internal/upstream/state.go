package upstream

import (
	"sync"
	"sync/atomic"
)

// State is the runtime state of one deployment.
type State struct {
	Slots  Slots
	Health Health
	// Engine is the last sample of the engine's own /metrics
	// (engine_load; MetricsPoller).
	Engine EngineLoad
	// credErr is the last credential error logged, so each distinct error
	// is logged once per deployment.
	credErr atomic.Pointer[string]
	// reported is the out-of-rotation reason last reported ("" or nil:
	// in rotation), so that a return is counted once.
	reported atomic.Pointer[string]
}

// MarkOut records that the deployment went out of rotation for reason
// (at the ejection or parking itself, so that a return is counted even
// when no heartbeat saw it out).
func (s *State) MarkOut(reason string) { s.reported.Store(&reason) }

// TakeReturn reports, once, that a deployment marked out is back: the
// reason it was out and true the first time it is called after MarkOut
// (or a report of it out), false otherwise. Reads are cheap; only a
// return writes.
func (s *State) TakeReturn() (string, bool) {
	old := s.reported.Load()
	if old == nil || *old == "" {
		return "", false
	}
	empty := ""
	if !s.reported.CompareAndSwap(old, &empty) {
		return "", false
	}
	return *old, true
}

// FirstCredentialError reports whether msg is a credential error not
// logged yet for this deployment (true once per distinct error, also
// between racing requests).
func (s *State) FirstCredentialError(msg string) bool {
	if old := s.credErr.Load(); old != nil && *old == msg {
		return false
	}
	if old := s.credErr.Swap(&msg); old != nil && *old == msg {
		return false // another request logged it meanwhile
	}
	return true
}

// States holds a State per deployment id. Entries of deleted deployments
// stay (a few bytes each) so that a re-created id keeps no surprising
// state beyond its health.
type States struct{ m sync.Map }

// Get returns the state of deployment id, creating it on first use.
func (s *States) Get(id string) *State {
	if v, ok := s.m.Load(id); ok {
		return v.(*State)
	}
	v, _ := s.m.LoadOrStore(id, new(State))
	return v.(*State)
}
