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

	"github.com/sluicegw/sluice/internal/budget"
)

// fakeLedger answers seed requests from a map (a scope without an entry
// has spent nothing) and records them. gate, when set, holds every answer
// until it is closed; err, when set, fails them.
type fakeLedger struct {
	mu    sync.Mutex
	spend map[ScopeRef]int64
	calls []seedCall
	gate  chan struct{}
	err   error
}

type seedCall struct {
	org   string
	needs []SeedNeed
}

func (f *fakeLedger) set(kind, id string, micros int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.spend == nil {
		f.spend = map[ScopeRef]int64{}
	}
	f.spend[ScopeRef{kind, id}] = micros
}

func (f *fakeLedger) seeds(ctx context.Context, org string, needs []SeedNeed) ([]int64, error) {
	f.mu.Lock()
	f.calls = append(f.calls, seedCall{org, append([]SeedNeed(nil), needs...)})
	gate, err := f.gate, f.err
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]int64, len(needs))
	for i, n := range needs {
		out[i] = f.spend[n.Scope]
	}
	return out, nil
}

func (f *fakeLedger) callList() []seedCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]seedCall(nil), f.calls...)
}

// windowID is the bw field of the current window of budget_duration w.
func (b *bundle) windowID(t testing.TB, w string) string {
	t.Helper()
	u, err := budget.ParseWindow(w)
	require.NoError(t, err)
	return fmt.Sprintf("%s%d/%d", u.Unit, u.N, b.windowIndex(t, w, time.Now()))
}

// windowIndex is the index of the window of w containing at, counted as
// lua/common.lua does (hours and days from the Unix epoch, months from
// January 1970).
func (b *bundle) windowIndex(t testing.TB, w string, at time.Time) int64 {
	t.Helper()
	u, err := budget.ParseWindow(w)
	require.NoError(t, err)
	start, end, err := BudgetWindow(w, at)
	require.NoError(t, err)
	switch u.Unit {
	case "mo":
		s := start.UTC()
		return (int64(s.Year()-1970)*12 + int64(s.Month()-1)) / u.N
	default:
		return start.Unix() / int64(end.Sub(start).Seconds())
	}
}

// budgetFields returns the budget fields of s's state hash that are set.
func (b *bundle) budgetFields(t testing.TB, s Scope) map[string]string {
	t.Helper()
	k := newKeyBuilder(b.prefix, b.org).scope(&s)
	vals, err := b.rdb.HMGet(context.Background(), k[0], "bw", "bs", "bp", "bpw").Result()
	require.NoError(t, err)
	out := map[string]string{}
	for i, f := range []string{"bw", "bs", "bp", "bpw"} {
		if v, ok := vals[i].(string); ok {
			out[f] = v
		}
	}
	return out
}

// TestUnseededAdmitsNothingUntilSeeded: a budget window Redis does not hold
// admits nothing, in any scope of the request, until the ledger's spend
// is written; then it starts from exactly that spend, asked once for the
// window Redis is in.
func TestUnseededAdmitsNothingUntilSeeded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	key := Scope{Kind: KindKey, ID: "k", RPM: 10, TPM: 1000, MaxParallel: 5}
	team := Scope{Kind: KindTeam, ID: "t", Budget: &Budget{CapMicros: 1000, Window: "1mo"}}
	b.ledger.err = errors.New("control plane unreachable")

	d := b.admit(t, b.req("r1", 100, 50, key, team))
	require.False(t, d.Allowed)
	r := d.Rejection
	require.Equal(t, ScopeRef{KindTeam, "t"}, r.Scope)
	require.Equal(t, LimitBudget, r.Limit)
	require.True(t, r.Unseeded)
	require.ErrorContains(t, r.Cause, "control plane unreachable")
	require.Equal(t, scopeState{}, b.state(t, key), "nothing consumed in the other scope")
	require.Empty(t, b.budgetFields(t, team), "no window started")
	n, err := b.rdb.Exists(context.Background(), newKeyBuilder(b.prefix, b.org).record("r1")).Result()
	require.NoError(t, err)
	require.Zero(t, n, "no record")

	// The ledger answers: the window starts from its spend.
	b.ledger.mu.Lock()
	b.ledger.err = nil
	b.ledger.mu.Unlock()
	b.ledger.set(KindTeam, "t", 960)
	d = b.admit(t, b.req("r2", 100, 50, key, team))
	require.True(t, d.Allowed)
	require.Equal(t, scopeState{Spend: 1010}, b.state(t, team))
	require.Equal(t, scopeState{Requests: 1, Tokens: 100, Leases: 1}, b.state(t, key))
	start, _, err := BudgetWindow("1mo", time.Now())
	require.NoError(t, err)
	calls := b.ledger.callList()
	require.Len(t, calls, 2)
	want := []SeedNeed{{Scope: ScopeRef{KindTeam, "t"}, Window: "1mo", WindowStart: start.Unix()}}
	require.Equal(t, seedCall{b.org, want}, calls[1])

	// Seeded once: further admissions read Redis only, and the cap holds.
	d = b.admit(t, b.req("r3", 0, 50, team))
	require.False(t, d.Allowed)
	require.Equal(t, LimitBudget, d.Rejection.Limit)
	require.False(t, d.Rejection.Unseeded)
	require.Equal(t, int64(1010), d.Rejection.SpendMicros)
	require.Len(t, b.ledger.callList(), 2)
}

// TestSeedRequestsAreShared: concurrent admissions of one missing window
// make one seed request; all wait for it and none is admitted before it.
func TestSeedRequestsAreShared(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	s := Scope{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1_000_000, Window: "1d"}}
	b.ledger.gate = make(chan struct{})
	b.ledger.set(KindKey, "k", 4000)
	const n = 20
	var wg sync.WaitGroup
	var admitted atomic.Int64
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := b.lim.Admit(context.Background(), b.req("r"+strconv.Itoa(i), 0, 10, s))
			if err == nil && d.Allowed {
				admitted.Add(1)
			}
		}()
	}
	// Every other admission has joined the first one's seed request
	// before it is answered (one that came later could find the window
	// missing after that request ended and before its seed was written,
	// and start another: on a loaded machine a goroutine can be that late).
	require.Eventually(t, func() bool { return len(b.ledger.callList()) == 1 && b.lim.seedWaiters() == n-1 },
		5*time.Second, 5*time.Millisecond)
	require.Zero(t, admitted.Load(), "admitted before the seed")
	require.Empty(t, b.budgetFields(t, s))
	close(b.ledger.gate)
	wg.Wait()
	require.Equal(t, int64(n), admitted.Load())
	require.Len(t, b.ledger.callList(), 1, "one seed request for all of them")
	require.Equal(t, int64(4000+n*10), b.state(t, s).Spend)
}

// TestSeedWaitIsBounded: a seed source that does not answer within
// SeedWait rejects with Unseeded after SeedWait, consuming nothing.
func TestSeedWaitIsBounded(t *testing.T) {
	t.Parallel()
	const wait = 300 * time.Millisecond
	b := setup(t, func(c *Config) { c.SeedWait = wait })
	s := Scope{Kind: KindUser, ID: "u", TPM: 1000, Budget: &Budget{CapMicros: 1000, Window: "1d"}}
	b.ledger.gate = make(chan struct{}) // never answers
	start := time.Now()
	d := b.admit(t, b.req("r", 100, 10, s))
	took := time.Since(start)
	require.False(t, d.Allowed)
	require.True(t, d.Rejection.Unseeded)
	require.ErrorIs(t, d.Rejection.Cause, context.DeadlineExceeded)
	require.GreaterOrEqual(t, took, wait)
	require.Less(t, took, wait+5*time.Second, "the wait is bounded")
	require.Equal(t, scopeState{}, b.state(t, s))

	// Without a source, a missing window admits nothing.
	b2 := setup(t, func(c *Config) { c.Seeds = nil })
	d = b2.admit(t, b2.req("r", 0, 10, s))
	require.True(t, d.Rejection.Unseeded)
	require.ErrorIs(t, d.Rejection.Cause, ErrNoSeedSource)
}

// TestOlderWindowStartsAtZero: a window that follows an older one of the
// same duration in an intact state starts at zero without a seed; a window
// of another duration (budget_duration changed) needs one.
func TestOlderWindowStartsAtZero(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1000, Window: "1d"}}
	hk := newKeyBuilder(b.prefix, b.org).scope(&s)[0]
	prev := b.windowIndex(t, "1d", time.Now()) - 1
	require.NoError(t, b.rdb.HSet(ctx, hk, "bw", fmt.Sprintf("d1/%d", prev), "bs", 999_999).Err())
	b.ledger.set(KindKey, "k", 777) // must not be asked
	d := b.admit(t, b.req("r1", 0, 10, s))
	require.True(t, d.Allowed, "the old window's spend does not carry over")
	require.Equal(t, map[string]string{"bw": b.windowID(t, "1d"), "bs": "10"}, b.budgetFields(t, s))
	require.Empty(t, b.ledger.callList())

	// budget_duration changes to 1mo: the daily window is not a window of
	// the new duration, so its spend comes from the ledger.
	s.Budget.Window = "1mo"
	d = b.admit(t, b.req("r2", 0, 10, s))
	require.True(t, d.Allowed)
	require.Equal(t, map[string]string{"bw": b.windowID(t, "1mo"), "bs": "787"}, b.budgetFields(t, s))
	require.Len(t, b.ledger.callList(), 1)
}

// TestWriteSeedsNeverOverwrites: seed.lua writes only missing windows of
// the current window start, and adds the reservations that waited.
func TestWriteSeedsNeverOverwrites(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	start, _, err := BudgetWindow("1d", time.Now())
	require.NoError(t, err)
	a := Scope{Kind: KindKey, ID: "a", Budget: &Budget{Window: "1d"}}
	seed := func(s Scope, at, micros int64) Seed {
		return Seed{Scope: ScopeRef{s.Kind, s.ID}, Window: s.Budget.Window, WindowStart: at, SpendMicros: micros}
	}
	got, err := b.lim.WriteSeeds(ctx, b.org, []Seed{seed(a, start.Unix(), 500), seed(a, start.Unix(), 900)})
	require.NoError(t, err)
	require.Equal(t, []int64{SeedWritten, SeedNotNeeded}, got, "the second seed of the same window does not overwrite the first")
	require.Equal(t, "500", b.budgetFields(t, a)["bs"])

	// A window that moves on after the seed was summed: stale.
	c := Scope{Kind: KindKey, ID: "c", Budget: &Budget{Window: "1d"}}
	got, err = b.lim.WriteSeeds(ctx, b.org, []Seed{seed(c, start.Unix()-86400, 500)})
	require.NoError(t, err)
	require.Equal(t, []int64{SeedStale}, got)
	require.Empty(t, b.budgetFields(t, c))

	// Reservations re-asserted while the window was missing are added.
	hk := newKeyBuilder(b.prefix, b.org).scope(&c)[0]
	require.NoError(t, b.rdb.HSet(ctx, hk, "bp", 40, "bpw", b.windowID(t, "1d")).Err())
	got, err = b.lim.WriteSeeds(ctx, b.org, []Seed{seed(c, start.Unix(), 500)})
	require.NoError(t, err)
	require.Equal(t, []int64{SeedWritten}, got)
	require.Equal(t, map[string]string{"bw": b.windowID(t, "1d"), "bs": "540"}, b.budgetFields(t, c))

	_, err = b.lim.WriteSeeds(ctx, b.org, []Seed{{Scope: ScopeRef{"nope", "x"}, Window: "1d"}})
	require.ErrorIs(t, err, ErrInvalidRequest)
}

// TestReassertedReservationJoinsTheSeed: a request running through a
// Redis state loss re-asserts its reservation without starting a window
// (renew.lua); the seed written afterwards adds it to the ledger's spend
// (the ledger does not have the running request yet), and the request's
// settlement replaces it by the real cost.
func TestReassertedReservationJoinsTheSeed(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.Quarantine = time.Millisecond })
	ctx := context.Background()
	s := Scope{Kind: KindTeam, ID: "t", TPM: 10_000, Budget: &Budget{CapMicros: 10_000, Window: "7d"}}
	b.ledger.set(KindTeam, "t", 1000)
	a := b.admit(t, b.req("a", 100, 300, s))
	require.True(t, a.Allowed)
	require.Equal(t, int64(1300), b.state(t, s).Spend)

	deleteKeys(t, b.rdb, b.prefix)
	st, err := b.lim.Renew(ctx, a.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewReasserted, st)
	require.Equal(t, map[string]string{"bp": "300", "bpw": b.windowID(t, "7d")}, b.budgetFields(t, s))
	// A second renewal only extends.
	st, err = b.lim.Renew(ctx, a.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)

	// Meanwhile the ledger recorded 1000 + 2000 of other requests.
	b.ledger.set(KindTeam, "t", 3000)
	time.Sleep(5 * time.Millisecond) // past the 1 ms quarantine
	d := b.admit(t, b.req("b", 100, 200, s))
	require.True(t, d.Allowed)
	require.Equal(t, map[string]string{"bw": b.windowID(t, "7d"), "bs": "3500"}, b.budgetFields(t, s), "seed 3000 + a's 300 + b's 200")

	res, err := b.lim.Settle(ctx, a.Lease, 100, 120)
	require.NoError(t, err)
	require.True(t, res.Applied)
	require.Equal(t, int64(3320), b.state(t, s).Spend, "a's reservation replaced by its real cost")
}

// seedWaiters counts the admissions waiting on another's seed request.
func (l *Limiter) seedWaiters() int {
	l.flights.mu.Lock()
	defer l.flights.mu.Unlock()
	n := 0
	for _, fl := range l.flights.m {
		n += fl.waiters
	}
	return n
}
