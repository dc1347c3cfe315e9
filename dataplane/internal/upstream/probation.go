package upstream

import (
	"sync"
	"sync/atomic"
)

// Probation is a deployment's stream probation at this instance
// (docs/resilience.md, "Stream probation"): a deployment this instance has
// not yet seen stream cleanly (a fresh proxy, a new deployment, or one
// that cut a stream or was ejected since) is on probation, and the
// forwarder holds its streams back from the clients like a half-open
// probe's, so that a cut within the hold is retried elsewhere. The first
// stream that ends cleanly, or outlives the hold's bounds, proves it:
// it leaves probation and every stream held on it at that moment is
// released at once (Proven's channel closes). A cut or an ejection puts
// it back (Revoke). The zero value is on probation.
//
// Reads (OnProbation of a proven deployment) are one atomic load; only
// the transitions take the lock.
type Probation struct {
	proven atomic.Bool
	mu     sync.Mutex
	// release is closed when the current probation ends (nil until a
	// stream waits on it).
	release chan struct{}
}

// OnProbation reports whether the deployment is on probation and, if
// so, a channel closed when it is proven (by another stream).
func (p *Probation) OnProbation() (bool, <-chan struct{}) {
	if p.proven.Load() {
		return false, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.proven.Load() {
		return false, nil
	}
	if p.release == nil {
		p.release = make(chan struct{})
	}
	return true, p.release
}

// Prove ends the probation (a stream ended cleanly or outlived the hold):
// the streams held on it are released. True when it was on probation.
func (p *Probation) Prove() bool {
	if p.proven.Load() {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.proven.Load() {
		return false
	}
	p.proven.Store(true)
	if p.release != nil {
		close(p.release)
		p.release = nil
	}
	return true
}

// Revoke puts the deployment back on probation (a stream cut, an
// ejection, a failed health check). True when it was proven.
func (p *Probation) Revoke() bool {
	if !p.proven.Load() {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.proven.Swap(false)
}

// Proven reports whether the deployment is out of probation.
func (p *Probation) Proven() bool { return p.proven.Load() }
