package limits

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
)

// Tests of sweepable requests (lease.go, sweep.go) against the machine's
// Redis: a request whose proxy stops renewing is settled by a sweeper with
// its last report, exactly once, whoever races for it.

const sweepTTL = 400 * time.Millisecond

func sweepSetup(t testing.TB) *bundle {
	return setup(t, func(c *Config) { c.LeaseTTL, c.RenewInterval = sweepTTL, 50*time.Millisecond })
}

func (b *bundle) recordRaw(t testing.TB, id string) string {
	t.Helper()
	v, err := b.rdb.Get(context.Background(), newKeyBuilder(b.prefix, b.org).record(id)).Result()
	if errors.Is(err, redis.Nil) {
		return ""
	}
	require.NoError(t, err)
	return v
}

func (b *bundle) indexed(t testing.TB) []string {
	t.Helper()
	ids, err := b.rdb.ZRange(context.Background(), newKeyBuilder(b.prefix, b.org).leaseIndex(), 0, -1).Result()
	require.NoError(t, err)
	sort.Strings(ids)
	return ids
}

// sweepUntil sweeps the bundle's org with lim until want requests were
// swept in total (or the deadline passes) and returns them.
func sweepUntil(t testing.TB, lim *Limiter, org string, want int, within time.Duration) []Swept {
	t.Helper()
	var out []Swept
	deadline := time.Now().Add(within)
	for len(out) < want && time.Now().Before(deadline) {
		s, err := lim.Sweep(context.Background(), []string{org}, 0)
		require.NoError(t, err)
		out = append(out, s...)
		if len(out) < want {
			time.Sleep(20 * time.Millisecond)
		}
	}
	require.Len(t, out, want, "swept within %s", within)
	return out
}

func TestSweepSettlesALostRequestWithItsLastReport(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	ctx := context.Background()
	key := Scope{Kind: KindKey, ID: "k 1", TPM: 10_000, MaxParallel: 5, Budget: &Budget{CapMicros: 1_000_000, SoftMicros: 1000, Window: "1d"}}
	team := Scope{Kind: KindTeam, ID: "t/1\nx", Budget: &Budget{CapMicros: 5000, Window: "1mo"}}
	other := Scope{Kind: KindKey, ID: "k2", TPM: 10_000, Budget: &Budget{CapMicros: 1_000_000, Window: "1d"}}

	req := b.req("lost", 100, 1000, key, team)
	req.Report = &Report{Event: []byte("admitted\nevent")}
	d := b.admit(t, req)
	require.True(t, d.Allowed)
	require.True(t, d.Lease.Sweepable())
	require.Equal(t, []string{"lost"}, b.indexed(t))
	require.Equal(t, scopeState{Tokens: 100, Leases: 1, Spend: 1000}, b.state(t, key))

	// A request admitted without a report is not indexed; one that settles
	// leaves the index.
	plain := b.admit(t, b.req("plain", 10, 10, other))
	require.False(t, plain.Lease.Sweepable())
	req = b.req("settled", 10, 10, other)
	req.Report = &Report{}
	done := b.admit(t, req)
	require.Equal(t, []string{"lost", "settled"}, b.indexed(t))
	res, err := b.lim.Settle(ctx, done.Lease, 5, 5)
	require.NoError(t, err)
	require.True(t, res.Applied)
	require.Equal(t, []string{"lost"}, b.indexed(t))

	// The live request reports its usage while it renews; nothing is swept.
	st, err := b.lim.RenewReport(ctx, d.Lease, Report{Tokens: 30, CostMicros: 300, Event: []byte("e1")})
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	st, err = b.lim.RenewReport(ctx, d.Lease, Report{Tokens: 50, CostMicros: 400, Event: []byte("e2")})
	// The lease was last renewed before this (by Redis's clock): the time
	// since is measured from here, not after the sweep below (whose call
	// took over 100 ms once on a loaded machine, so the lease seemed swept
	// before it expired).
	renewed := time.Now()
	require.NoError(t, err)
	require.Equal(t, RenewExtended, st)
	require.True(t, strings.HasSuffix(b.recordRaw(t, "lost"), "\n50 400\n"+encodeSpec([]Scope{key, team})+"\ne2"), "record %q", b.recordRaw(t, "lost"))
	swept, err := b.lim.Sweep(ctx, []string{b.org}, 0)
	require.NoError(t, err)
	require.Empty(t, swept, "a live lease is not swept")

	// Its proxy dies: the lease expires and a sweep settles it with the
	// last report.
	swept = sweepUntil(t, b.lim, b.org, 1, 5*time.Second)
	require.GreaterOrEqual(t, time.Since(renewed), sweepTTL-50*time.Millisecond, "swept before its lease expired")
	// 400 of 5000 crosses no threshold of the team; the key's soft budget
	// (1000) is not reached either.
	require.Equal(t, Swept{OrgID: b.org, RequestID: "lost", Tokens: 50, CostMicros: 400, Event: []byte("e2")}, swept[0])
	require.Equal(t, scopeState{Tokens: 50, Spend: 400}, b.state(t, key))
	require.Equal(t, scopeState{Spend: 400}, b.state(t, team))
	require.Equal(t, "swept", b.recordRaw(t, "lost"))
	require.Empty(t, b.indexed(t))

	// The proxy was only late: its renewal learns the request was swept,
	// its settlement changes nothing.
	st, err = b.lim.RenewReport(ctx, d.Lease, Report{Tokens: 80, CostMicros: 700})
	require.NoError(t, err)
	require.Equal(t, RenewSwept, st)
	res, err = b.lim.Settle(ctx, d.Lease, 80, 700)
	require.NoError(t, err)
	require.Equal(t, SettleResult{Swept: true}, res)
	require.Equal(t, scopeState{Tokens: 50, Spend: 400}, b.state(t, key))
	require.Empty(t, b.indexed(t))
	swept, err = b.lim.Sweep(ctx, []string{b.org}, 0)
	require.NoError(t, err)
	require.Empty(t, swept)

	// The request without a report is never swept: its lease expires, its
	// reservation stays until it settles.
	require.Equal(t, int64(10+5), b.state(t, other).Spend)
	_, err = b.lim.Settle(ctx, plain.Lease, 1, 1)
	require.NoError(t, err)
}

// TestSweepAlerts: a sweep settlement crossing a threshold reports it.
func TestSweepAlerts(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	s := Scope{Kind: KindUser, ID: "u", Budget: &Budget{CapMicros: 1000, Window: "1d"}}
	req := b.req("r", 10, 100, s)
	req.Report = &Report{Tokens: 10, CostMicros: 600}
	require.True(t, b.admit(t, req).Allowed)
	swept := sweepUntil(t, b.lim, b.org, 1, 5*time.Second)
	require.Equal(t, int64(600), swept[0].CostMicros)
	require.Nil(t, swept[0].Event)
	require.Equal(t, []BudgetAlert{{Scope: ScopeRef{KindUser, "u"}, Percent: 50, SpendMicros: 600, CapMicros: 1000, Window: "1d"}}, swept[0].Alerts)
	require.Equal(t, scopeState{Spend: 600}, b.state(t, s))
}

// TestSweepersRace: four sweepers (two limiters, two goroutines each)
// sweep 300 lost requests at once: each is swept exactly once and the
// budget holds exactly their reported costs.
func TestSweepersRace(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	pipe, err := redispipe.New(redispipe.Options{Addr: redisAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	other, err := New(Config{Pipe: pipe, KeyPrefix: b.prefix, CallTimeout: time.Second, LeaseTTL: sweepTTL, RenewInterval: 50 * time.Millisecond})
	require.NoError(t, err)

	const n = 300
	s := Scope{Kind: KindTeam, ID: "t", TPM: 1e9, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e12, Window: "30d"}}
	var wantCost int64
	for i := range n {
		req := b.req(fmt.Sprint("r", i), 100, 1000, s)
		req.Report = &Report{Tokens: int64(i), CostMicros: int64(i % 17), Event: []byte(fmt.Sprint("ev", i))}
		wantCost += int64(i % 17)
		require.True(t, b.admit(t, req).Allowed)
	}
	time.Sleep(sweepTTL)

	var mu sync.Mutex
	seen := map[string]int{}
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := range 4 {
		lim := b.lim
		if w%2 == 1 {
			lim = other
		}
		wg.Go(func() {
			<-start
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				swept, err := lim.Sweep(context.Background(), []string{"other-org", b.org}, 40)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, x := range swept {
					if string(x.Event) != fmt.Sprint("ev", x.Tokens) {
						t.Errorf("request %s: event %q with %d tokens", x.RequestID, x.Event, x.Tokens)
					}
					seen[x.RequestID]++
				}
				total := len(seen)
				mu.Unlock()
				if total == n {
					return
				}
			}
		})
	}
	close(start)
	wg.Wait()
	require.Len(t, seen, n)
	for id, c := range seen {
		require.Equal(t, 1, c, "request %s swept %d times", id, c)
	}
	st := b.state(t, s)
	require.Equal(t, wantCost, st.Spend, "the budget holds exactly the reported costs")
	require.Equal(t, int64(n*(n-1)/2), st.Tokens, "the tpm window holds exactly the reported tokens")
	require.Zero(t, st.Leases)
	require.Empty(t, b.indexed(t))
}

// TestSweepIsBounded: one Sweep settles at most its limit; later passes
// take the rest.
func TestSweepIsBounded(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	s := Scope{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1e12, Window: "30d"}}
	for i := range 100 {
		req := b.req(fmt.Sprint("r", i), 1, 10, s)
		req.Report = &Report{CostMicros: 1}
		require.True(t, b.admit(t, req).Allowed)
	}
	time.Sleep(sweepTTL + 20*time.Millisecond)
	var passes []int
	for len(b.indexed(t)) > 0 {
		swept, err := b.lim.Sweep(context.Background(), []string{b.org}, 30)
		require.NoError(t, err)
		require.LessOrEqual(t, len(swept), 30)
		passes = append(passes, len(swept))
		require.Less(t, len(passes), 10)
	}
	require.Equal(t, []int{30, 30, 30, 10}, passes)
	require.Equal(t, int64(100), b.state(t, s).Spend)
}

// TestSweepAfterStateLoss: a request re-asserted by its renewal after
// Redis lost the org's state is sweepable again, and a stale index entry
// whose record is gone is dropped. Its budget window is missing, so the
// re-assertion leaves its reservation waiting for a seed ('bp') and the
// sweep does not start the window either (seed.go): the swept cost reaches
// the budget through the ledger (the usage event the sweeper publishes),
// whose spend seeds the next admission.
func TestSweepAfterStateLoss(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", MaxParallel: 10, Budget: &Budget{CapMicros: 1e9, Window: "1d"}}
	req := b.req("r", 10, 1000, s)
	req.Report = &Report{Tokens: 1, CostMicros: 1}
	d := b.admit(t, req)
	require.True(t, d.Allowed)
	req = b.req("gone", 10, 1000, s)
	req.Report = &Report{}
	require.True(t, b.admit(t, req).Allowed)
	// The state is lost except for the index (the record of "gone" too).
	kb := newKeyBuilder(b.prefix, b.org)
	require.NoError(t, b.rdb.Del(ctx, kb.record("r"), kb.record("gone"), kb.scope(&s)[0], kb.scope(&s)[1]).Err())
	require.NoError(t, b.rdb.ZRem(ctx, kb.leaseIndex(), "r").Err())
	st, err := b.lim.RenewReport(ctx, d.Lease, Report{Tokens: 7, CostMicros: 70, Event: []byte("x")})
	require.NoError(t, err)
	require.Equal(t, RenewReasserted, st)
	require.Equal(t, []string{"gone", "r"}, b.indexed(t))
	head, report, ok := strings.Cut(b.recordRaw(t, "r"), "\n")
	require.True(t, ok, "the re-asserted record carries the report")
	require.True(t, strings.HasSuffix(head, fmt.Sprintf(" p%d", b.windowIndex(t, "1d", time.Now()))), "record head %q", head)
	require.Equal(t, "7 70\n"+encodeSpec([]Scope{s})+"\nx", report)
	hk := kb.scope(&s)[0]
	require.Equal(t, []any{nil, "1000", b.windowID(t, "1d")}, b.rdb.HMGet(ctx, hk, "bw", "bp", "bpw").Val(),
		"the window is not started by the re-assertion; the reservation waits for the seed")

	swept := sweepUntil(t, b.lim, b.org, 1, 5*time.Second)
	require.Equal(t, "r", swept[0].RequestID)
	require.Equal(t, int64(70), swept[0].CostMicros)
	require.Equal(t, []byte("x"), swept[0].Event)
	require.Equal(t, []any{nil, nil, nil}, b.rdb.HMGet(ctx, hk, "bw", "bp", "bpw").Val(),
		"the sweep does not start the window; the reservation no longer waits")
	require.Empty(t, b.indexed(t), "the entry without a record was dropped")

	// The sweeper's usage event reached the ledger: the next admission is
	// seeded with it.
	b.ledger.set(KindKey, "k", 70)
	require.True(t, b.admit(t, b.req("next", 1, 10, s)).Allowed)
	require.Equal(t, int64(70+10), b.state(t, s).Spend)
}

// TestSweepAfterStateLossSeededMeanwhile: the window of a re-asserted
// request is seeded (by another admission) before the request is swept:
// the seed took its waiting reservation, which the sweep replaces by the
// reported cost.
func TestSweepAfterStateLossSeededMeanwhile(t *testing.T) {
	t.Parallel()
	b := sweepSetup(t)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", MaxParallel: 10, Budget: &Budget{CapMicros: 1e9, Window: "1d"}}
	req := b.req("r", 10, 1000, s)
	req.Report = &Report{}
	d := b.admit(t, req)
	require.True(t, d.Allowed)
	kb := newKeyBuilder(b.prefix, b.org)
	require.NoError(t, b.rdb.Del(ctx, kb.record("r"), kb.scope(&s)[0], kb.scope(&s)[1], kb.leaseIndex()).Err())
	st, err := b.lim.RenewReport(ctx, d.Lease, Report{Tokens: 7, CostMicros: 70, Event: []byte("x")})
	require.NoError(t, err)
	require.Equal(t, RenewReasserted, st)
	require.Equal(t, []string{"r"}, b.indexed(t))

	// The ledger holds 500 of other requests; the seed adds the waiting
	// reservation (1000) and the admission its own (10).
	b.ledger.set(KindKey, "k", 500)
	other := b.admit(t, b.req("other", 1, 10, s))
	require.True(t, other.Allowed)
	require.Equal(t, int64(500+1000+10), b.state(t, s).Spend)

	swept := sweepUntil(t, b.lim, b.org, 1, 5*time.Second)
	require.Equal(t, "r", swept[0].RequestID)
	require.Equal(t, int64(70), swept[0].CostMicros)
	require.Equal(t, int64(500+70+10), b.state(t, s).Spend, "the sweep replaced the reservation by the reported cost")
	require.Empty(t, b.indexed(t))
	_, err = b.lim.Settle(ctx, other.Lease, 1, 10)
	require.NoError(t, err)
}

// TestSweepGoRedisStore runs the sweep tests through go-redis (the store
// of Redis Cluster; setup picks it for subtests under "goredis/").
func TestSweepGoRedisStore(t *testing.T) {
	for name, f := range map[string]func(*testing.T){
		"SettlesALostRequest": TestSweepSettlesALostRequestWithItsLastReport, "Race": TestSweepersRace,
		"Bounded": TestSweepIsBounded, "AfterStateLoss": TestSweepAfterStateLoss,
		"AfterStateLossSeededMeanwhile": TestSweepAfterStateLossSeededMeanwhile,
	} {
		t.Run("goredis/"+name, f)
	}
}

func TestSpecRoundTrip(t *testing.T) {
	t.Parallel()
	scopes := []Scope{
		{Kind: KindKey, ID: "k 1:2", RPM: 5, TPM: 7, MaxParallel: 3, Budget: &Budget{CapMicros: 9, SoftMicros: 4, Window: "30d"}},
		{Kind: KindTeamModel, ID: "t/qwen\n30b", TPM: 1},
		{Kind: KindDeployment, ID: "d", MaxParallel: 1},
		{Kind: KindOrg, ID: "o", Budget: &Budget{Window: "1mo"}},
	}
	got, err := decodeSpec(encodeSpec(scopes))
	require.NoError(t, err)
	want := []Scope{
		{Kind: KindKey, ID: "k 1:2", RPM: 1, TPM: 1, MaxParallel: 1, Budget: scopes[0].Budget},
		{Kind: KindTeamModel, ID: "t/qwen\n30b", TPM: 1},
		{Kind: KindDeployment, ID: "d", MaxParallel: 1},
		{Kind: KindOrg, ID: "o", Budget: scopes[3].Budget},
	}
	require.Equal(t, want, got)
	for _, bad := range []string{"", "2 key 1:k 0 -", "1 nope 1:k 0 -", "1 key 9:k 0 -", "1 key 1:k x -", "1 key 1:k 0 1d,1", "1 key 1:k 0 1d,1,1,1,1", "1 key 1:k 0 1y,1,1"} {
		_, err := decodeSpec(bad)
		require.ErrorIs(t, err, errBadSpec, "%q", bad)
	}
}

// TestClusterSweep: sweepable admissions, renewals and sweeps of several
// orgs on a 3-node Redis Cluster (a call touching two slots would fail with
// CROSSSLOT).
func TestClusterSweep(t *testing.T) {
	t.Parallel()
	addrs := startCluster(t)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	// Budget windows are seeded (seed.lua) on the cluster too.
	led := &fakeLedger{}
	lim, err := New(Config{Client: rdb, KeyPrefix: "sluice:", CallTimeout: time.Second, Quarantine: time.Millisecond,
		LeaseTTL: sweepTTL, RenewInterval: 50 * time.Millisecond, Seeds: led.seeds})
	require.NoError(t, err)
	ctx := context.Background()
	var orgs []string
	for o := range 8 {
		org := fmt.Sprintf("org-%d", o)
		orgs = append(orgs, org)
		require.NoError(t, lim.Bootstrap(ctx, org))
		scopes := []Scope{
			{Kind: KindKey, ID: "k", TPM: 1e6, MaxParallel: 10, Budget: &Budget{CapMicros: 1e9, Window: "30d"}},
			{Kind: KindTeam, ID: "t", Budget: &Budget{CapMicros: 1e9, Window: "1d"}},
			{Kind: KindOrg, ID: org, MaxParallel: 100},
		}
		for r := range 3 {
			req := Request{OrgID: org, RequestID: fmt.Sprint("r", r), Scopes: scopes, EstTokens: 100, MaxCostMicros: 1000,
				Report: &Report{Event: []byte("e")}}
			d, err := lim.Admit(ctx, req)
			require.NoError(t, err)
			require.True(t, d.Allowed, "%+v", d.Rejection)
			st, err := lim.RenewReport(ctx, d.Lease, Report{Tokens: 10, CostMicros: 5, Event: []byte(org)})
			require.NoError(t, err)
			require.Equal(t, RenewExtended, st)
		}
	}
	var swept []Swept
	require.Eventually(t, func() bool {
		s, err := lim.Sweep(ctx, orgs, 0)
		require.NoError(t, err)
		swept = append(swept, s...)
		return len(swept) == 3*len(orgs)
	}, 10*time.Second, 50*time.Millisecond)
	for _, s := range swept {
		require.Equal(t, s.OrgID, string(s.Event))
		require.Equal(t, int64(5), s.CostMicros)
	}
	for _, org := range orgs {
		kb := newKeyBuilder("sluice:", org)
		bs, err := rdb.HGet(ctx, kb.scope(&Scope{Kind: KindKey, ID: "k"})[0], "bs").Int64()
		require.NoError(t, err)
		require.Equal(t, int64(15), bs, "org %s: the reservations were replaced by the reports", org)
		n, err := rdb.Exists(ctx, kb.leaseIndex()).Result()
		require.NoError(t, err)
		require.Zero(t, n)
	}
}
