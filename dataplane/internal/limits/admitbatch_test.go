package limits

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// gateStore holds the first admit.lua call until the test releases it,
// so that the admissions arriving meanwhile queue behind it, and counts
// the admit.lua calls and the requests they carried.
type gateStore struct {
	store
	gate  chan struct{}
	first atomic.Bool
	calls atomic.Int64
	reqs  atomic.Int64
}

func (g *gateStore) eval(ctx context.Context, s *script, c scriptCall) ([]int64, error) {
	if s == admitScript {
		g.calls.Add(1)
		n, _ := strconv.Atoi(c.args.strings()[6].(string)) // ARGV[7]: the number of requests
		g.reqs.Add(int64(n))
		if g.first.CompareAndSwap(false, true) {
			<-g.gate
			ctx = context.Background() // the held call itself succeeds
		}
	}
	return g.store.eval(ctx, s, c)
}

// gated installs a gateStore on b's limiter.
func gated(b *bundle) *gateStore {
	g := &gateStore{store: b.lim.store, gate: make(chan struct{})}
	b.lim.store = g
	return g
}

// queued returns the admissions of org waiting for a call.
func (b *admitBatcher) queued(org string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if o := b.orgs[org]; o != nil {
		return len(o.q)
	}
	return 0
}

// idle reports whether no call of org is in flight.
func (b *admitBatcher) idle(org string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.orgs[org] == nil
}

// admitMany admits reqs concurrently while the first admission's call is
// held, releasing it once all the others queued behind it.
func admitMany(t *testing.T, b *bundle, g *gateStore, reqs []Request) ([]Decision, []error) {
	t.Helper()
	decs := make([]Decision, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		decs[0], errs[0] = b.lim.Admit(context.Background(), reqs[0])
	}()
	testsvc.Eventually(t, func() bool { return g.calls.Load() == 1 }, 5*time.Second, time.Millisecond)
	for i := 1; i < len(reqs); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			decs[i], errs[i] = b.lim.Admit(context.Background(), reqs[i])
		}()
	}
	testsvc.Eventually(t, func() bool { return b.lim.admits.queued(b.org) == len(reqs)-1 }, 5*time.Second, time.Millisecond)
	close(g.gate)
	wg.Wait()
	return decs, errs
}

// TestAdmitBatchConcurrencyCapExact: 200 concurrent admissions of one
// org against a team concurrency cap of 50 (and per-key rpm limits of
// keys that share it) go in a few batched calls and admit exactly 50.
func TestAdmitBatchConcurrencyCapExact(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	g := gated(b)
	team := Scope{Kind: KindTeam, ID: "t", MaxParallel: 50}
	reqs := make([]Request, 200)
	for i := range reqs {
		key := Scope{Kind: KindKey, ID: fmt.Sprint("k", i%4), RPM: 1000, TPM: 1e6}
		reqs[i] = b.req(fmt.Sprint("r", i), 10, 0, key, team)
	}
	decs, errs := admitMany(t, b, g, reqs)
	admitted := 0
	for i, d := range decs {
		require.NoError(t, errs[i])
		if d.Allowed {
			admitted++
			continue
		}
		require.Equal(t, LimitParallel, d.Rejection.Limit)
		require.Equal(t, ScopeRef{Kind: KindTeam, ID: "t"}, d.Rejection.Scope)
	}
	require.Equal(t, 50, admitted)
	require.EqualValues(t, 50, b.state(t, team).Leases)
	// Each key counts the requests of it that were admitted, and their
	// tokens: the rejections consumed nothing.
	var reqsCounted, tokens int64
	for k := range 4 {
		st := b.state(t, Scope{Kind: KindKey, ID: fmt.Sprint("k", k), RPM: 1000, TPM: 1e6})
		reqsCounted += st.Requests
		tokens += st.Tokens
	}
	require.EqualValues(t, 50, reqsCounted)
	require.EqualValues(t, 500, tokens)
	// The held call, then the 199 others in batches of at most 32.
	require.LessOrEqual(t, g.calls.Load(), int64(1+(199+maxAdmitBatch-1)/maxAdmitBatch))
	require.EqualValues(t, 200, g.reqs.Load(), "every admission ran once")
	// Settled, the slots are free again.
	for _, d := range decs {
		if d.Allowed {
			_, err := b.lim.Settle(context.Background(), d.Lease, 10, 0)
			require.NoError(t, err)
		}
	}
	require.EqualValues(t, 0, b.state(t, team).Leases)
}

// TestAdmitBatchRateAndBudgetExact: batched admissions decide what the
// same admissions one by one would: an rpm limit of 37 admits 37 of 100,
// a budget of 10 requests' reservations admits 10 (after its seed).
func TestAdmitBatchRateAndBudgetExact(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	g := gated(b)
	org := Scope{Kind: KindOrg, ID: b.org, RPM: 37}
	reqs := make([]Request, 100)
	for i := range reqs {
		reqs[i] = b.req(fmt.Sprint("r", i), 0, 0, Scope{Kind: KindKey, ID: fmt.Sprint("k", i%7), RPM: 1000}, org)
	}
	decs, errs := admitMany(t, b, g, reqs)
	admitted := 0
	for i, d := range decs {
		require.NoError(t, errs[i])
		if d.Allowed {
			admitted++
			require.Equal(t, int64(37), d.Headers.LimitRequests)
			continue
		}
		require.Equal(t, LimitRPM, d.Rejection.Limit)
		require.Positive(t, d.Rejection.RetryAfter)
		require.Zero(t, d.Headers.RemainingRequests)
	}
	require.Equal(t, 37, admitted)
	require.EqualValues(t, 37, b.state(t, org).Requests)

	// A budget: 10,000 µ$ cap, 1,000 reserved per request.
	b2 := setup(t, nil)
	team := Scope{Kind: KindTeam, ID: "t", Budget: &Budget{CapMicros: 10_000, Window: "1d"}}
	// Seed the window first, so the batch decides on it.
	d, err := b2.lim.Admit(context.Background(), b2.req("seed", 0, 0, team))
	require.NoError(t, err)
	require.True(t, d.Allowed)
	g2 := gated(b2)
	reqs = make([]Request, 40)
	for i := range reqs {
		reqs[i] = b2.req(fmt.Sprint("r", i), 0, 1000, team)
	}
	decs, errs = admitMany(t, b2, g2, reqs)
	admitted = 0
	for i, d := range decs {
		require.NoError(t, errs[i])
		if d.Allowed {
			admitted++
			continue
		}
		require.Equal(t, LimitBudget, d.Rejection.Limit)
		require.EqualValues(t, 10_000, d.Rejection.SpendMicros)
	}
	require.Equal(t, 10, admitted)
	require.EqualValues(t, 10_000, b2.state(t, team).Spend)
}

// TestAdmitBatchDuplicateAndAbandoned: a request id admitted twice in one
// batch is a duplicate the second time; an admission whose deadline
// passes while it waits for its org's call in flight fails closed and
// never runs.
func TestAdmitBatchDuplicateAndAbandoned(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.CallTimeout = 300 * time.Millisecond })
	g := gated(b)
	s := Scope{Kind: KindKey, ID: "k", MaxParallel: 10}
	decs, errs := admitMany(t, b, g, []Request{b.req("a", 0, 0, s), b.req("b", 0, 0, s), b.req("b", 0, 0, s)})
	require.NoError(t, errs[0])
	require.True(t, decs[0].Allowed)
	var dup, ok int
	for i := 1; i < 3; i++ {
		switch {
		case errors.Is(errs[i], ErrDuplicateRequest):
			dup++
		case errs[i] == nil && decs[i].Allowed:
			ok++
		}
	}
	require.Equal(t, 1, dup)
	require.Equal(t, 1, ok)
	require.EqualValues(t, 2, b.state(t, s).Leases)
	testsvc.Eventually(t, func() bool { return b.lim.admits.idle(b.org) }, 5*time.Second, time.Millisecond)

	// Abandoned: held behind a call that outlives its deadline.
	g.gate = make(chan struct{})
	g.first.Store(false)
	g.calls.Store(0)
	held := make(chan error, 1)
	go func() {
		_, err := b.lim.Admit(context.Background(), b.req("held", 0, 0, s))
		held <- err
	}()
	testsvc.Eventually(t, func() bool { return g.calls.Load() == 1 }, 5*time.Second, time.Millisecond)
	start := time.Now()
	d, err := b.lim.Admit(context.Background(), b.req("late", 0, 0, s))
	require.ErrorIs(t, err, ErrUnavailable)
	require.NotNil(t, d.Lease, "the caller cancels it like any failed admission")
	require.Less(t, time.Since(start), 2*time.Second)
	close(g.gate)
	require.NoError(t, <-held)
	testsvc.Eventually(t, func() bool { return b.lim.admits.idle(b.org) }, 5*time.Second, time.Millisecond)
	require.EqualValues(t, 1, g.calls.Load(), "the abandoned admission never ran")
	n, err := b.rdb.Exists(context.Background(), newKeyBuilder(b.prefix, b.org).record("late")).Result()
	require.NoError(t, err)
	require.Zero(t, n)
	require.EqualValues(t, 3, b.state(t, s).Leases)
}
