package upstream

import (
	"testing"
	"time"
)

func closed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestProbation: a new deployment is on probation; its proof releases
// every waiter at once and ends it; a revoke (a cut) starts a new one
// with a new channel; an ejection for failures and a failed health check
// revoke it.
func TestProbation(t *testing.T) {
	var h Health
	on, a := h.Probation.OnProbation()
	if !on || a == nil {
		t.Fatal("a new deployment is not on probation")
	}
	on, b := h.Probation.OnProbation()
	if !on || b != a {
		t.Fatal("two streams on probation wait on different proofs")
	}
	if closed(a) {
		t.Fatal("released before its proof")
	}
	if !h.Probation.Prove() || h.Probation.Prove() {
		t.Fatal("Prove reports the first proof only")
	}
	if !closed(a) {
		t.Fatal("the proof did not release the held streams")
	}
	if on, _ := h.Probation.OnProbation(); on {
		t.Fatal("proven, yet on probation")
	}
	if !h.Probation.Revoke() || h.Probation.Revoke() {
		t.Fatal("Revoke reports the first revoke only")
	}
	on, c := h.Probation.OnProbation()
	if !on || c == a || closed(c) {
		t.Fatal("a revoked deployment is not on a new probation")
	}

	// Ejected after consecutive failures: back on probation.
	h.Probation.Prove()
	now := time.Now()
	for range EjectAfterFailures {
		h.FailedBackoff(now, time.Second, time.Minute)
	}
	if h.Probation.Proven() {
		t.Fatal("an ejection left the deployment proven")
	}
	// A failed health check too.
	st := &States{}
	st.Get("d").Health.Probation.Prove()
	ck := &Checker{States: st, UnhealthyThreshold: 1, HealthyThreshold: 1, count: map[string]int{}}
	ck.record("d", false)
	if st.Get("d").Health.Probation.Proven() {
		t.Fatal("a failed health check left the deployment proven")
	}
}
