package limits

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestSlicesCarveAlertsReported: a carve whose reservation takes a budget
// past thresholds marks them sent in Redis, so it reports them itself
// (OnCarveAlerts), with the scope's org and team, even when no request
// ever takes from the slice: here every request reserves more than the
// slice holds, so none settles from it (before the sink, such alerts
// waited for a settlement that never came, and were lost).
func TestSlicesCarveAlertsReported(t *testing.T) {
	const capMicros = 1_000_000
	f := newSliceFleet(t, 1, 0, 0, SliceConfig{MinBudgetMicros: 1000, Tick: 10 * time.Millisecond, Share: 1}, false)
	lim := f.lims[0]
	var mu sync.Mutex
	var got []BudgetAlert
	lim.OnCarveAlerts(func(as []BudgetAlert) {
		mu.Lock()
		got = append(got, as...)
		mu.Unlock()
	})
	scopes := []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: capMicros, Window: "1d", Team: "team-1"}}}
	ctx := context.Background()
	// One request admitted exactly: it reserves 600k and spends 400k (40 %,
	// no threshold). The scope's demand makes the worker carve what the
	// reserve leaves: 500k, which takes the spend to 90 % (50 and 85 %).
	d, err := lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: "first", Scopes: scopes, MaxCostMicros: 600_000})
	require.NoError(t, err)
	require.True(t, d.Allowed)
	res, err := lim.Settle(ctx, d.Lease, 0, 400_000)
	require.NoError(t, err)
	require.Empty(t, res.Alerts)
	// The worker starts once that request is settled (a carve before its
	// settlement would make the settlement cross the thresholds).
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = lim.RunSlices(wctx) })
	defer func() { stop(); wg.Wait() }()
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= 2
	}, 10*time.Second, 5*time.Millisecond, "the carve's alerts were not reported")
	// A request the slice cannot hold is admitted exactly (the spend, the
	// slice counted, is below the cap) and spends nothing: its settlement
	// reports no alert, the thresholds being sent already.
	d, err = lim.Admit(ctx, Request{OrgID: f.b.org, RequestID: "second", Scopes: scopes, MaxCostMicros: 600_000})
	require.NoError(t, err)
	require.True(t, d.Allowed)
	require.Positive(t, lim.SliceStats().HeldBudgetMicros, "the slice stays unused")
	res, err = lim.Settle(ctx, d.Lease, 0, 0)
	require.NoError(t, err)
	require.Empty(t, res.Alerts)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, got, 2, "each threshold reported once")
	for i, pct := range []int64{50, 85} {
		a := got[i]
		require.Equal(t, pct, a.Percent)
		require.Equal(t, ScopeRef{Kind: KindKey, ID: "k"}, a.Scope)
		require.Equal(t, f.b.org, a.OrgID)
		require.Equal(t, "team-1", a.TeamID)
		require.Equal(t, int64(capMicros), a.CapMicros)
		require.Equal(t, "1d", a.Window)
		require.Greater(t, a.SpendMicros, int64(capMicros)*pct/100)
	}
}
