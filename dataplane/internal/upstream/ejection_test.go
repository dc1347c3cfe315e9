package upstream

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestInRotation(t *testing.T) {
	now := time.Unix(1000, 0)
	pool := func(n int) []*State {
		out := make([]*State, n)
		for i := range out {
			out[i] = new(State)
		}
		return out
	}
	s := pool(4)
	require.Equal(t, []bool{true, true, true, true}, InRotation(s, now, 50))
	s[0].Health.Park(now, 10*time.Second)
	s[1].Health.Park(now, 20*time.Second)
	require.Equal(t, []bool{false, false, true, true}, InRotation(s, now, 50))
	// A third ejection would take 75% out: the one returning first is
	// used again.
	s[2].Health.Park(now, 5*time.Second)
	require.Equal(t, []bool{false, false, true, true}, InRotation(s, now, 50))
	s[3].Health.Park(now, 30*time.Second)
	require.Equal(t, []bool{true, false, true, false}, InRotation(s, now, 50), "the two returning first are used")
	one := pool(1)
	one[0].Health.Park(now, time.Second)
	require.Equal(t, []bool{true}, InRotation(one, now, 50), "a pool is never emptied")
	// At least one deployment may be out, even of a pool of two at 10%.
	two := pool(2)
	two[1].Health.Park(now, time.Second)
	require.Equal(t, []bool{true, false}, InRotation(two, now, 10))
}

// TestStandings: the deployments the maximum ejection percentage keeps
// in rotation are last resorts, parked ones after ejected ones; past the
// panic threshold every one is routed to as healthy.
func TestStandings(t *testing.T) {
	now := time.Unix(1000, 0)
	pool := func() []*State {
		s := make([]*State, 4)
		for i := range s {
			s[i] = new(State)
		}
		return s
	}
	eject := func(st *State, d time.Duration) {
		for range EjectAfterFailures {
			st.Health.FailedBackoff(now, d, time.Minute)
		}
	}
	s := pool()
	require.Equal(t, []Standing{Healthy, Healthy, Healthy, Healthy}, Standings(s, now, 50, 0))
	s[0].Health.Park(now, 30*time.Second) // a 429 with Retry-After 30
	eject(s[1], 40*time.Second)           // a stream cutter
	s[2].Health.Park(now, time.Second)    // queue full, Retry-After 1
	// Three of four out, two allowed: the one back first (s[2]) is kept
	// in, as a last resort behind the healthy s[3].
	require.Equal(t, []Standing{Excluded, Excluded, CappedParked, Healthy}, Standings(s, now, 50, 0))
	require.Equal(t, "parked", CappedParked.Label(&s[2].Health, now))
	require.Equal(t, []Standing{Panic, Panic, Panic, Healthy}, Standings(s, now, 50, 70))

	// An ejection ending first is kept in as Capped.
	s = pool()
	s[0].Health.Park(now, 30*time.Second)
	eject(s[1], 10*time.Second)
	s[2].Health.Park(now, 20*time.Second)
	require.Equal(t, []Standing{Excluded, Capped, Excluded, Healthy}, Standings(s, now, 50, 0))
	require.Equal(t, "ejected", Capped.Label(&s[1].Health, now))
	require.Less(t, Probe.Rank(), Capped.Rank())
	require.Less(t, Capped.Rank(), CappedParked.Rank())
	require.Equal(t, Healthy.Rank(), Probe.Rank())
	// Once its ejection ended, it is a probe.
	require.Equal(t, []Standing{Excluded, Probe, Excluded, Healthy}, Standings(s, now.Add(11*time.Second), 50, 0))
}

// TestHalfOpen: a timed ejection ends half-open: one probe at a time,
// out while it runs; its success closes the deployment, its failure
// ejects it again at once with the doubled backoff. Failures of attempts
// that started before the ejection do not extend it.
func TestHalfOpen(t *testing.T) {
	const base = 50 * time.Millisecond
	var h Health
	now := time.Now()
	for i := range EjectAfterFailures {
		d := h.FailedBackoff(now, base, time.Second)
		require.Equal(t, i == EjectAfterFailures-1, d > 0)
	}
	require.True(t, h.Ejected(now))
	// Stragglers failing during the ejection: not counted.
	for range 2 * EjectAfterFailures {
		require.Zero(t, h.FailedBackoff(now.Add(base/2), base, time.Second))
	}
	later := now.Add(base + time.Millisecond)
	require.False(t, h.Ejected(later))
	require.True(t, h.HalfOpen(later))
	require.True(t, h.TryProbe())
	require.False(t, h.TryProbe(), "one probe at a time")
	require.True(t, h.Ejected(later), "out while its probe runs")
	// The probe fails: ejected again at once, for twice the backoff.
	require.Equal(t, 2*base, h.FailedBackoff(later, base, time.Second))
	h.EndProbe()
	require.True(t, h.Ejected(later.Add(2*base-time.Millisecond)))
	back := later.Add(2*base + time.Millisecond)
	require.True(t, h.HalfOpen(back))
	// A probe that neither succeeds nor fails leaves it half-open.
	require.True(t, h.TryProbe())
	h.EndProbe()
	require.True(t, h.HalfOpen(back))
	require.False(t, h.Ejected(back))
	// A success (Succeeded reads the clock: past the ejection) closes it.
	for !time.Now().After(back) {
		time.Sleep(5 * time.Millisecond)
	}
	require.True(t, h.TryProbe())
	h.Succeeded()
	h.EndProbe()
	require.False(t, h.HalfOpen(time.Now()))
	require.False(t, h.Ejected(time.Now()))
	// A parking ends half-open too.
	var p Health
	p.Park(now, time.Second)
	require.False(t, p.HalfOpen(now))
	require.True(t, p.HalfOpen(now.Add(2*time.Second)))
}
