package limits

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestSlicesDeadInstanceBudgetReclaimedWithoutCarve: a limiter that dies
// holding a budget slice gets all but its watermark back once its lease
// expires also when no limiter carves for the scope any more: an exact
// admission of the scope (a limiter without slices) reclaims it
// (admit.lua), and so does a sweeper's pass (ReclaimBudgetLeases,
// reclaim.lua) with no call for the scope at all. Before, only the next
// carve.lua call of the scope did, so a scope admitted exactly from then
// on (near its cap, or by data planes without slices) kept the dead one's
// free slice counted until its budget window ended.
func TestSlicesDeadInstanceBudgetReclaimedWithoutCarve(t *testing.T) {
	for _, by := range []string{"exact", "sweeper"} {
		t.Run(by, func(t *testing.T) {
			const capMicros, reserve = 1_000_000, 1_000
			const ttl = time.Second
			f := newSliceFleetCfg(t, 1, func(c *Config) { c.LeaseTTL, c.RenewInterval = ttl, 100*time.Millisecond },
				SliceConfig{MinBudgetMicros: 1000, Tick: 10 * time.Millisecond, Share: 1}, false)
			dead, exact := f.lims[0], f.b.lim // f.b.lim has no slices
			scopes := []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: capMicros, Window: "1d"}}}
			kill := deadWorker(dead) // the dead limiter's worker, stopped without release
			var seq atomic.Int64
			spend := func(l *Limiter, cost int64) bool {
				d, err := l.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("r%d", seq.Add(1)), Scopes: scopes, MaxCostMicros: reserve})
				require.NoError(t, err)
				if !d.Allowed {
					return false
				}
				_, err = l.Settle(context.Background(), d.Lease, 0, cost)
				require.NoError(t, err)
				return true
			}
			var spentDead int64
			require.Eventually(t, func() bool {
				require.True(t, spend(dead, reserve/2))
				spentDead += reserve / 2
				return dead.SliceStats().HeldBudgetMicros >= capMicros/5
			}, 5*time.Second, time.Millisecond)
			kill()
			died := time.Now()
			free := dead.SliceStats().HeldBudgetMicros
			sc := dead.slices.lookup(f.b.org, &scopes[0])
			sc.mu.Lock()
			atRisk := sc.bB - sc.bN
			sc.mu.Unlock()
			atDeath := f.b.state(t, scopes[0]).Spend
			require.Greater(t, atDeath, spentDead+free/2, "the free slice is counted in Redis")

			// Past the lease (renewed at the dead one's last call, before
			// its death), nothing has reclaimed it yet: no call of the
			// scope was made.
			time.Sleep(time.Until(died.Add(ttl + 100*time.Millisecond)))
			require.Equal(t, atDeath, f.b.state(t, scopes[0]).Spend)
			var reclaimed int64
			switch by {
			case "exact":
				require.True(t, spend(exact, 0), "an exact admission of the scope")
			case "sweeper":
				var err error
				reclaimed, err = exact.ReclaimBudgetLeases(context.Background(), []string{f.b.org, "other-org"}, 0)
				require.NoError(t, err)
			}
			after := f.b.state(t, scopes[0]).Spend
			t.Logf("%s: dead limiter spent %d µ$, held %d µ$ free (watermark %d µ$ ahead); spend in Redis %d µ$ at its death, %d µ$ after (reclaimed %d µ$ by the sweeper)",
				by, spentDead, free, atRisk, atDeath, after, reclaimed)
			require.Equal(t, spentDead+atRisk, after, "Redis keeps the real spend plus the dead one's watermark")
			if by == "sweeper" {
				require.Equal(t, atDeath-after, reclaimed)
				// The index no longer names the scope, and a second pass
				// reclaims nothing.
				n, err := exact.ReclaimBudgetLeases(context.Background(), []string{f.b.org}, 0)
				require.NoError(t, err)
				require.Zero(t, n)
				require.Zero(t, f.b.rdb.ZCard(context.Background(), newKeyBuilder(f.b.prefix, f.b.org).budgetLeaseIndex()).Val())
			}
		})
	}
}

// TestSlicesReturnSlices: ReturnSlices (a drained data plane's) gives
// every slice back while the worker keeps running: afterwards Redis holds
// exactly the real spend, no free slot and no rate unit beyond the ones
// used.
func TestSlicesReturnSlices(t *testing.T) {
	f := newSliceFleet(t, 1, 6*time.Second, 100*time.Millisecond,
		SliceConfig{MinBudgetMicros: 1000, MinParallel: 1, Tick: 10 * time.Millisecond}, true)
	l := f.lims[0]
	scopes := []Scope{{Kind: KindKey, ID: "k", RPM: 100_000, MaxParallel: 100, Budget: &Budget{CapMicros: 10_000_000, Window: "1d"}}}
	var real int64
	for i := range 300 {
		d, err := l.Admit(context.Background(), Request{OrgID: f.b.org, RequestID: fmt.Sprintf("q%d", i), Scopes: scopes, MaxCostMicros: 1000})
		require.NoError(t, err)
		require.True(t, d.Allowed)
		_, err = l.Settle(context.Background(), d.Lease, 0, 400)
		require.NoError(t, err)
		real += 400
		if i%50 == 0 {
			time.Sleep(20 * time.Millisecond) // let the worker carve
		}
	}
	st := l.SliceStats()
	require.Positive(t, st.Calls, "the worker carved")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, l.ReturnSlices(ctx))
	// And they stay back: the worker, still running, does not carve
	// again for the demand before the drain.
	time.Sleep(100 * time.Millisecond)
	s := f.b.state(t, scopes[0])
	t.Logf("after ReturnSlices: spend %d µ$ (real %d), slices held %+v", s.Spend, real, l.SliceStats())
	require.Equal(t, real, s.Spend, "Redis holds exactly the real spend")
	require.Zero(t, f.b.rdb.ZCount(context.Background(), newKeyBuilder(f.b.prefix, f.b.org).scope(&scopes[0])[1],
		strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Val(), "no slot left in the lease set")
}

// TestSlicesLimiterSweeps: a limiter with slices on sweeps (its store,
// wrapped to watch Redis's liveness, keeps the sweeper's reads). Before,
// Sweep and ReclaimBudgetLeases failed with "the limits store cannot
// sweep" on every data plane with slices, so a killed proxy's requests
// were never swept.
func TestSlicesLimiterSweeps(t *testing.T) {
	b := setup(t, func(c *Config) {
		c.Slices = SliceConfig{Enabled: true}
		c.LeaseTTL, c.RenewInterval = time.Second, 100*time.Millisecond
	})
	scopes := []Scope{{Kind: KindKey, ID: "k", MaxParallel: 3}}
	d, err := b.lim.Admit(context.Background(), Request{OrgID: b.org, RequestID: "lost", Scopes: scopes, Report: &Report{Tokens: 1}})
	require.NoError(t, err)
	require.True(t, d.Allowed)
	var swept []Swept
	require.Eventually(t, func() bool {
		swept, err = b.lim.Sweep(context.Background(), []string{b.org}, 0)
		require.NoError(t, err)
		return len(swept) == 1
	}, 5*time.Second, 50*time.Millisecond, "the lost request is swept")
	require.Equal(t, "lost", swept[0].RequestID)
	_, err = b.lim.ReclaimBudgetLeases(context.Background(), []string{b.org}, 0)
	require.NoError(t, err)
}
