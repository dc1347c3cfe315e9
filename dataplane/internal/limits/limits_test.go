package limits

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	mathrand "math/rand/v2"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/redispipe"
	"github.com/sluicegw/sluice/internal/budget"
)

const redisAddr = "127.0.0.1:6379"

// bundle is what setup returns: a client on the machine's Redis, a limiter
// whose keys carry a random per-test prefix, and an org for the test.
type bundle struct {
	// rdb is a *redis.Client, or a *redis.ClusterClient under
	// TestClusterStore.
	rdb    redis.UniversalClient
	lim    *Limiter
	prefix string
	org    string
	// ledger answers the limiter's seed requests (Config.Seeds).
	ledger *fakeLedger
}

func randHex(t testing.TB) string {
	var b [6]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	return hex.EncodeToString(b[:])
}

// setup connects to the machine's Redis (failing when it is missing) and
// returns a limiter with a random key prefix; mod adjusts the config. The
// org's epoch is primed so tests start outside quarantine (except the
// quarantine test, which uses a fresh org).
func setup(t testing.TB, mod func(*Config)) *bundle {
	t.Helper()
	return setupAt(t, redisAddr, mod)
}

// setupAt is setup on the Redis at addr (a dedicated redis-server of a
// benchmark, script_bench_test.go).
func setupAt(t testing.TB, addr string, mod func(*Config)) *bundle {
	t.Helper()
	var rdb redis.UniversalClient
	if rc := testCluster.Load(); rc != nil && strings.Contains(t.Name(), "/cluster/") {
		// TestClusterStore: the same test on a 3-master Redis Cluster.
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: rc.Addrs, ContextTimeoutEnabled: true})
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	}
	t.Cleanup(func() { _ = rdb.Close() })
	require.NoError(t, rdb.Ping(context.Background()).Err(), "the limits tests need Redis at %s", addr)
	prefix := "sluice-test-" + randHex(t) + ":"
	t.Cleanup(func() { deleteKeys(t, rdb, prefix) })
	led := &fakeLedger{}
	cfg := Config{KeyPrefix: prefix, CallTimeout: time.Second, Seeds: led.seeds}
	if _, ok := rdb.(*redis.ClusterClient); ok {
		cfg.Client = rdb
	} else if strings.Contains(t.Name(), "/goredis/") {
		// TestGoRedisStore: the same test through go-redis (the store of
		// Redis Cluster).
		cfg.Client = rdb
	} else {
		pipe, err := redispipe.New(redispipe.Options{Addr: addr})
		require.NoError(t, err)
		t.Cleanup(func() { _ = pipe.Close() })
		cfg.Pipe = pipe
	}
	if mod != nil {
		mod(&cfg)
	}
	lim, err := New(cfg)
	require.NoError(t, err)
	b := &bundle{rdb: rdb, lim: lim, prefix: prefix, org: "org-" + randHex(t), ledger: led}
	b.primeEpoch(t, b.org)
	return b
}

func (b *bundle) primeEpoch(t testing.TB, org string) {
	require.NoError(t, b.rdb.Set(context.Background(), newKeyBuilder(b.prefix, org).epoch(), 0, 0).Err())
}

// scanKeys returns every key under prefix, from every master of a
// Cluster.
func scanKeys(t testing.TB, rdb redis.UniversalClient, prefix string) []string {
	ctx := context.Background()
	var mu sync.Mutex
	var keys []string
	scan := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			mu.Lock()
			keys = append(keys, iter.Val())
			mu.Unlock()
		}
		return iter.Err()
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		require.NoError(t, c.ForEachMaster(ctx, scan))
	case *redis.Client:
		require.NoError(t, scan(ctx, c))
	default:
		t.Fatalf("scanKeys: %T", rdb)
	}
	return keys
}

// deleteKeys removes every key under prefix (the test's "FLUSH").
func deleteKeys(t testing.TB, rdb redis.UniversalClient, prefix string) {
	for _, k := range scanKeys(t, rdb, prefix) { // one by one: a Cluster's keys are on several slots
		require.NoError(t, rdb.Del(context.Background(), k).Err())
	}
}

// scopeState is what Redis holds for one scope.
type scopeState struct {
	Requests, Tokens, Leases, Spend int64
}

func (b *bundle) state(t testing.TB, s Scope) scopeState {
	t.Helper()
	ctx := context.Background()
	k := newKeyBuilder(b.prefix, b.org).scope(&s)
	m, err := b.rdb.HGetAll(ctx, k[0]).Result()
	require.NoError(t, err)
	// sum adds the buckets of window p and checks its bookkeeping.
	sum := func(p string) int64 {
		var n int64
		for f, v := range m {
			if !strings.HasPrefix(f, p) || f == p+"t" || f == p+"o" {
				continue
			}
			x, err := strconv.ParseInt(v, 10, 64)
			require.NoError(t, err, "field %s", f)
			require.Positive(t, x, "window %s bucket %s", p, f)
			n += x
		}
		tv, ok := m[p+"t"]
		_, hasO := m[p+"o"]
		require.Equal(t, ok, hasO, "window %s: 't' and 'o' come together", p)
		if ok {
			// The bookkeeping total equals the buckets it sums.
			require.Equal(t, strconv.FormatInt(n, 10), tv, "window %s of %s: 't' is not the sum of its buckets", p, k[0])
		} else {
			require.Zero(t, n, "window %s has buckets but no bookkeeping", p)
		}
		return n
	}
	st := scopeState{Requests: sum("r"), Tokens: sum("k")}
	// Live leases (expired ones are pruned lazily).
	st.Leases, err = b.rdb.ZCount(ctx, k[1], "("+strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
	require.NoError(t, err)
	if s.Budget != nil {
		st.Spend, _ = strconv.ParseInt(m["bs"], 10, 64)
	}
	return st
}

func (b *bundle) req(id string, est, cost int64, scopes ...Scope) Request {
	return Request{OrgID: b.org, RequestID: id, Scopes: scopes, EstTokens: est, MaxCostMicros: cost}
}

func (b *bundle) admit(t testing.TB, r Request) Decision {
	t.Helper()
	d, err := b.lim.Admit(context.Background(), r)
	require.NoError(t, err)
	return d
}

func TestAdmitAllOrNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	key := Scope{Kind: KindKey, ID: "k1", RPM: 10, TPM: 1000, MaxParallel: 5, Budget: &Budget{CapMicros: 1_000_000, Window: "1d"}}
	team := Scope{Kind: KindTeam, ID: "t1", RPM: 1}
	user := Scope{Kind: KindUser, ID: "u1", Budget: &Budget{CapMicros: 100, Window: "1mo"}}
	b.ledger.set(KindUser, "u1", 100)

	d := b.admit(t, b.req("r1", 100, 50, key, team))
	require.True(t, d.Allowed)
	before := b.state(t, key)
	require.Equal(t, scopeState{Requests: 1, Tokens: 100, Leases: 1, Spend: 50}, before)

	// The team's rpm rejects: nothing is consumed in the key scope.
	d = b.admit(t, b.req("r2", 100, 50, key, team))
	require.False(t, d.Allowed)
	require.Equal(t, ScopeRef{KindTeam, "t1"}, d.Rejection.Scope)
	require.Equal(t, LimitRPM, d.Rejection.Limit)
	require.Equal(t, before, b.state(t, key))
	n, err := b.rdb.Exists(context.Background(), newKeyBuilder(b.prefix, b.org).record("r2")).Result()
	require.NoError(t, err)
	require.Zero(t, n, "a rejected request leaves no record")

	// A budget scope listed after the key rejects: the key is untouched too.
	d = b.admit(t, b.req("r3", 100, 50, key, user))
	require.False(t, d.Allowed)
	require.Equal(t, LimitBudget, d.Rejection.Limit)
	require.Equal(t, int64(100), d.Rejection.SpendMicros)
	require.Equal(t, int64(100), d.Rejection.CapMicros)
	require.Equal(t, before, b.state(t, key))
	require.Equal(t, scopeState{Spend: 100}, b.state(t, user))
}

func TestRPMSlidingWindow(t *testing.T) {
	t.Parallel()
	const limit, window = 5, 2 * time.Second
	b := setup(t, func(c *Config) { c.rateWindow, c.rateBucket = window, 100*time.Millisecond })
	s := Scope{Kind: KindKey, ID: "k", RPM: limit}

	var admitted []time.Time
	var retried bool
	deadline := time.Now().Add(5 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		d := b.admit(t, b.req(fmt.Sprint("r", i), 0, 0, s))
		if d.Allowed {
			admitted = append(admitted, time.Now())
			require.Equal(t, int64(limit), d.Headers.LimitRequests)
			continue
		}
		r := d.Rejection
		require.Equal(t, LimitRPM, r.Limit)
		require.Positive(t, r.RetryAfter)
		require.LessOrEqual(t, r.RetryAfter, window+100*time.Millisecond)
		require.Zero(t, d.Headers.RemainingRequests)
		if !retried {
			// Waiting exactly RetryAfter is enough.
			time.Sleep(r.RetryAfter + 5*time.Millisecond)
			d := b.admit(t, b.req(fmt.Sprint("retry", i), 0, 0, s))
			require.True(t, d.Allowed, "admitted after waiting retry-after")
			admitted = append(admitted, time.Now())
			retried = true
			continue
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Bound: never more than the limit in any window-long interval.
	for i := range admitted {
		j := sort.Search(len(admitted), func(j int) bool { return admitted[j].After(admitted[i].Add(window - 20*time.Millisecond)) })
		require.LessOrEqual(t, j-i, limit, "admissions in the window starting at %d", i)
	}
	// Utilisation: the window (plus one bucket) never stays under-used.
	require.GreaterOrEqual(t, len(admitted), 2*limit)
}

func TestTPMReconcile(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	s := Scope{Kind: KindTeamModel, ID: "t1/qwen:30b", TPM: 100}

	d1 := b.admit(t, b.req("r1", 60, 0, s))
	require.True(t, d1.Allowed)
	require.Equal(t, RateHeaders{LimitTokens: 100, RemainingTokens: 40, ResetTokens: d1.Headers.ResetTokens}, d1.Headers)

	d := b.admit(t, b.req("r2", 60, 0, s))
	require.False(t, d.Allowed)
	require.Equal(t, LimitTPM, d.Rejection.Limit)
	require.Greater(t, d.Rejection.RetryAfter, 55*time.Second)
	require.LessOrEqual(t, d.Rejection.RetryAfter, 61*time.Second)

	res, err := b.lim.Settle(context.Background(), d1.Lease, 10, 0)
	require.NoError(t, err)
	require.True(t, res.Applied)
	require.Equal(t, int64(10), b.state(t, s).Tokens)

	d2 := b.admit(t, b.req("r2", 60, 0, s))
	require.True(t, d2.Allowed, "the reconciled estimate frees tokens")
	require.Equal(t, int64(30), d2.Headers.RemainingTokens)

	d = b.admit(t, b.req("r3", 200, 0, s))
	require.False(t, d.Allowed)
	require.True(t, d.Rejection.Never, "an estimate above the limit never passes")

	// Under-estimates are charged too: 10 + 80.
	_, err = b.lim.Settle(context.Background(), d2.Lease, 80, 0)
	require.NoError(t, err)
	require.Equal(t, int64(90), b.state(t, s).Tokens)
}

func TestLeasesReleaseAndHeal(t *testing.T) {
	t.Parallel()
	const ttl = time.Second
	b := setup(t, func(c *Config) { c.LeaseTTL, c.RenewInterval = ttl, 100*time.Millisecond })
	ctx := context.Background()
	s := Scope{Kind: KindTeam, ID: "t", MaxParallel: 2}

	a, c := b.admit(t, b.req("a", 0, 0, s)), b.admit(t, b.req("b", 0, 0, s))
	require.True(t, a.Allowed)
	require.True(t, c.Allowed)
	d := b.admit(t, b.req("c", 0, 0, s))
	require.False(t, d.Allowed)
	require.Equal(t, LimitParallel, d.Rejection.Limit)
	require.Positive(t, d.Rejection.RetryAfter)
	require.LessOrEqual(t, d.Rejection.RetryAfter, DefaultParallelRetryMax, "a parallel rejection is a short wait")
	require.Equal(t, "1", d.Rejection.RetryAfterSeconds())

	// Settle releases the slot.
	_, err := b.lim.Settle(ctx, a.Lease, 0, 0)
	require.NoError(t, err)
	require.Equal(t, int64(1), b.state(t, s).Leases)
	d = b.admit(t, b.req("c", 0, 0, s))
	require.True(t, d.Allowed)

	// A crashed proxy never settles "b" and "c"; a live stream "r" renews.
	time.Sleep(ttl / 2)
	d = b.admit(t, b.req("r", 0, 0, s))
	require.False(t, d.Allowed)
	time.Sleep(ttl/2 + 50*time.Millisecond)
	live := b.admit(t, b.req("r", 0, 0, s))
	require.True(t, live.Allowed, "the crashed slots healed within the TTL")
	for range 8 {
		time.Sleep(ttl / 5)
		st, err := b.lim.Renew(ctx, live.Lease)
		require.NoError(t, err)
		require.Equal(t, RenewExtended, st)
	}
	// 1.6 s after admission, the renewed lease still holds its slot.
	require.Equal(t, int64(1), b.state(t, s).Leases)
	_, err = b.lim.Settle(ctx, live.Lease, 0, 0)
	require.NoError(t, err)
	require.Zero(t, b.state(t, s).Leases)
}

func TestSettleIdempotent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", TPM: 1000, MaxParallel: 3, Budget: &Budget{CapMicros: 10_000, Window: "7d"}}

	d := b.admit(t, b.req("r", 100, 500, s))
	require.True(t, d.Allowed)
	require.Equal(t, scopeState{Tokens: 100, Leases: 1, Spend: 500}, b.state(t, s))
	_, err := b.lim.Admit(ctx, b.req("r", 100, 500, s))
	require.ErrorIs(t, err, ErrDuplicateRequest)

	res, err := b.lim.Settle(ctx, d.Lease, 40, 200)
	require.NoError(t, err)
	require.Equal(t, SettleResult{Applied: true}, res)
	want := scopeState{Tokens: 40, Spend: 200}
	require.Equal(t, want, b.state(t, s))

	// Again from this process, and again in Redis (as another data plane
	// would, bypassing the in-process flag): both are no-ops.
	res, err = b.lim.Settle(ctx, d.Lease, 40, 200)
	require.NoError(t, err)
	require.False(t, res.Applied)
	d.Lease.settled.Store(false)
	res, err = b.lim.Settle(ctx, d.Lease, 40, 200)
	require.NoError(t, err)
	require.False(t, res.Applied)
	require.Equal(t, want, b.state(t, s))

	// A renewal racing the settlement does not resurrect the lease.
	d.Lease.settled.Store(false)
	st, err := b.lim.Renew(ctx, d.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewSettled, st)
	require.Equal(t, want, b.state(t, s))
}

func TestBudgetReserveReconcile(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindUser, ID: "u", Budget: &Budget{CapMicros: 1000, SoftMicros: 300, Window: "1d"}}

	d1 := b.admit(t, b.req("r1", 0, 600, s))
	d2 := b.admit(t, b.req("r2", 0, 600, s))
	require.True(t, d1.Allowed)
	require.True(t, d2.Allowed, "spend 600 < cap 1000 admits")
	require.Equal(t, int64(1200), b.state(t, s).Spend)

	d := b.admit(t, b.req("r3", 0, 600, s))
	require.False(t, d.Allowed)
	r := d.Rejection
	require.Equal(t, LimitBudget, r.Limit)
	require.Equal(t, int64(1200), r.SpendMicros)
	require.Equal(t, int64(1000), r.CapMicros)
	_, end, err := BudgetWindow("1d", time.Now())
	require.NoError(t, err)
	require.Equal(t, end, r.WindowEnd)
	require.InDelta(t, time.Until(end).Seconds(), r.RetryAfter.Seconds(), 2, "retry-after runs to the window's end")

	res, err := b.lim.Settle(ctx, d1.Lease, 0, 100)
	require.NoError(t, err)
	require.Equal(t, int64(700), b.state(t, s).Spend)
	// 700 ≥ soft 300 and ≥ 50 % of the cap: each alert fires once.
	var got []int64
	for _, a := range res.Alerts {
		got = append(got, a.Percent)
	}
	require.ElementsMatch(t, []int64{50, 0}, got)
	res, err = b.lim.Settle(ctx, d2.Lease, 0, 100)
	require.NoError(t, err)
	require.Empty(t, res.Alerts, "thresholds fire once per window")
	require.Equal(t, int64(200), b.state(t, s).Spend)

	// A cold counter starts from the ledger's spend of its window.
	b.ledger.set(KindOrg, "o", 950)
	seeded := Scope{Kind: KindOrg, ID: "o", Budget: &Budget{CapMicros: 1000, Window: "1mo"}}
	d = b.admit(t, b.req("r4", 0, 10, seeded))
	require.True(t, d.Allowed)
	require.Equal(t, int64(960), b.state(t, seeded).Spend)
}

func TestBudgetConcurrentNeverOvershoots(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	const capMicros, maxCost, actual = 200_000, 3_000, 2_500
	team := Scope{Kind: KindTeam, ID: "t", MaxParallel: 1000, Budget: &Budget{CapMicros: capMicros, Window: "30d"}}
	key := Scope{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 10 * capMicros, Window: "1d"}}

	var admitted atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for g := range 100 {
		wg.Go(func() {
			for i := 0; ; i++ {
				d, err := b.lim.Admit(ctx, b.req(fmt.Sprintf("g%d-%d", g, i), 10, maxCost, key, team))
				if err != nil {
					errs <- err
					return
				}
				if !d.Allowed {
					if d.Rejection.Limit != LimitBudget {
						errs <- fmt.Errorf("rejected by %s", d.Rejection.Limit)
					}
					return
				}
				admitted.Add(1)
				if _, err := b.lim.Settle(ctx, d.Lease, 10, actual); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	spend := b.state(t, team).Spend
	require.Equal(t, admitted.Load()*actual, spend, "the counter equals the settled costs")
	require.GreaterOrEqual(t, spend, int64(capMicros))
	require.Less(t, spend, int64(capMicros+maxCost), "overshoot below one request's reservation")
	require.Equal(t, spend, b.state(t, key).Spend)
	require.Zero(t, b.state(t, team).Leases)
}

// silentListener accepts TCP connections and never answers.
func silentListener(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// TestGoRedisStore runs the core tests through go-redis, the store used
// for Redis Cluster (setup picks it for subtests under "goredis/").
func TestGoRedisStore(t *testing.T) {
	for name, f := range map[string]func(*testing.T){
		"AdmitAllOrNothing": TestAdmitAllOrNothing, "TPMReconcile": TestTPMReconcile,
		"LeasesReleaseAndHeal": TestLeasesReleaseAndHeal, "SettleIdempotent": TestSettleIdempotent,
		"BudgetReserveReconcile": TestBudgetReserveReconcile, "SettleBatch": TestSettleBatch,
		"CancelUndoesALateAdmission": TestCancelUndoesALateAdmission,
	} {
		t.Run("goredis/"+name, f)
	}
}

func TestTimeoutIsUnavailable(t *testing.T) {
	t.Parallel()
	addr := silentListener(t)
	rdb := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	pipe, err := redispipe.New(redispipe.Options{Addr: addr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	for _, cfg := range []Config{{Client: rdb}, {Pipe: pipe}} {
		lim, err := New(cfg)
		require.NoError(t, err)
		req := Request{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: KindKey, ID: "k", MaxParallel: 1}}}
		for range 3 {
			start := time.Now()
			d, err := lim.Admit(context.Background(), req)
			require.ErrorIs(t, err, ErrUnavailable)
			require.True(t, MayHaveRun(err), "the command was sent: %v", err)
			require.NotNil(t, d.Lease, "a failed admission returns its lease for Cancel")
			require.Less(t, time.Since(start), 150*time.Millisecond, "the per-call timeout is %v", DefaultCallTimeout)
		}
	}

	// A refused connection: nothing was sent.
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	deadAddr := dead.Addr().String()
	require.NoError(t, dead.Close())
	pipe, err = redispipe.New(redispipe.Options{Addr: deadAddr})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pipe.Close() })
	lim, err := New(Config{Pipe: pipe})
	require.NoError(t, err)
	_, err = lim.Admit(context.Background(), Request{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: KindKey, ID: "k", MaxParallel: 1}}})
	require.ErrorIs(t, err, ErrUnavailable)
	require.False(t, MayHaveRun(err), "%v", err)

	_, err = New(Config{})
	require.ErrorContains(t, err, "exactly one of Pipe and Client")
	_, err = New(Config{Pipe: pipe, Client: rdb})
	require.ErrorContains(t, err, "exactly one of Pipe and Client")

	// A client that ignores context deadlines is refused up front.
	plain := redis.NewClient(&redis.Options{Addr: redisAddr})
	t.Cleanup(func() { _ = plain.Close() })
	_, err = New(Config{Client: plain})
	require.ErrorContains(t, err, "ContextTimeoutEnabled")
}

func TestEpochQuarantineAfterStateLoss(t *testing.T) {
	t.Parallel()
	const quarantine = 800 * time.Millisecond
	b := setup(t, func(c *Config) {
		c.LeaseTTL, c.RenewInterval, c.Quarantine = 5*time.Second, 200*time.Millisecond, quarantine
	})
	ctx := context.Background()
	b.org = "fresh-" + randHex(t) // no epoch yet: as after a restart
	b.ledger.set(KindTeam, "t", 5000)
	par := Scope{Kind: KindTeam, ID: "t", MaxParallel: 1, Budget: &Budget{CapMicros: 1_000_000, Window: "1d"}}
	rpmOnly := Scope{Kind: KindKey, ID: "k", RPM: 100}

	d := b.admit(t, b.req("q", 0, 100, par))
	require.False(t, d.Allowed)
	require.True(t, d.Rejection.Quarantined)
	require.Equal(t, LimitParallel, d.Rejection.Limit)
	require.Positive(t, d.Rejection.RetryAfter)
	require.LessOrEqual(t, d.Rejection.RetryAfter, quarantine)
	require.True(t, b.admit(t, b.req("k1", 0, 0, rpmOnly)).Allowed, "quarantine only holds parallel limits")

	time.Sleep(d.Rejection.RetryAfter + 10*time.Millisecond)
	a := b.admit(t, b.req("a", 0, 100, par))
	require.True(t, a.Allowed)
	require.Equal(t, int64(5100), b.state(t, par).Spend, "seeded then reserved")

	// Redis loses everything. The next admission starts a new epoch and a
	// quarantine; the live request re-asserts its lease, and its
	// reservation waits for the budget window's seed (none is started
	// from anything but the ledger).
	deleteKeys(t, b.rdb, b.prefix)
	d = b.admit(t, b.req("b", 0, 100, par))
	require.False(t, d.Allowed)
	require.True(t, d.Rejection.Quarantined)
	require.NotEqual(t, a.Epoch, d.Epoch)
	st, err := b.lim.Renew(ctx, a.Lease)
	require.NoError(t, err)
	require.Equal(t, RenewReasserted, st)
	require.Equal(t, scopeState{Leases: 1}, b.state(t, par), "no budget window without a seed")
	require.Equal(t, map[string]string{"bp": "100", "bpw": b.windowID(t, "1d")}, b.budgetFields(t, par))

	time.Sleep(quarantine)
	d = b.admit(t, b.req("b", 0, 100, par))
	require.False(t, d.Allowed, "the re-asserted lease holds the only slot")
	require.False(t, d.Rejection.Quarantined)

	// The request ends before any seed: its cost goes to the ledger
	// (5000 + 40) and its reservation stops waiting.
	res, err := b.lim.Settle(ctx, a.Lease, 0, 40)
	require.NoError(t, err)
	require.True(t, res.Applied)
	require.False(t, res.WithoutRecord)
	require.Equal(t, scopeState{}, b.state(t, par))
	require.Empty(t, b.budgetFields(t, par))
	b.ledger.set(KindTeam, "t", 5040)
	require.True(t, b.admit(t, b.req("b", 0, 100, par)).Allowed)
	require.Equal(t, scopeState{Leases: 1, Spend: 5140}, b.state(t, par), "re-seeded from the ledger, not reset to zero")
}

func TestBootstrapSkipsQuarantineOnlyForNewOrgs(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *Config) { c.Quarantine = 5 * time.Second })
	ctx := context.Background()
	par := Scope{Kind: KindTeam, ID: "t", MaxParallel: 2}
	b.org = "new-" + randHex(t)
	require.NoError(t, b.lim.Bootstrap(ctx, b.org))
	d := b.admit(t, b.req("a", 0, 0, par))
	require.True(t, d.Allowed, "a bootstrapped (new) org is not quarantined")

	// Bootstrap never overwrites an existing epoch: after a loss the new
	// epoch's quarantine holds even if a data plane bootstraps again.
	deleteKeys(t, b.rdb, b.prefix)
	d = b.admit(t, b.req("b", 0, 0, par))
	require.True(t, d.Rejection.Quarantined)
	require.NoError(t, b.lim.Bootstrap(ctx, b.org))
	d = b.admit(t, b.req("c", 0, 0, par))
	require.False(t, d.Allowed)
	require.True(t, d.Rejection.Quarantined)
	require.ErrorIs(t, b.lim.Bootstrap(ctx, "bad{org}"), ErrInvalidRequest)
}

func TestSettleWithoutRecordChargesActual(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindCustomer, ID: "c", TPM: 1000, MaxParallel: 2, Budget: &Budget{CapMicros: 1000, Window: "12h"}}
	d := b.admit(t, b.req("r", 50, 300, s))
	require.True(t, d.Allowed)
	deleteKeys(t, b.rdb, b.prefix) // lost before any renewal
	res, err := b.lim.Settle(ctx, d.Lease, 70, 120)
	require.NoError(t, err)
	require.Equal(t, SettleResult{Applied: true, WithoutRecord: true}, res)
	// The budget window is not started by a settlement: the ledger has the
	// request's cost, and the next admission's seed counts it.
	require.Equal(t, scopeState{Tokens: 70}, b.state(t, s))
	require.Empty(t, b.budgetFields(t, s))
}

func TestInvalidRequests(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, r := range []Request{
		{OrgID: "", RequestID: "r"},
		{OrgID: "a{b}", RequestID: "r"},
		{OrgID: "o", RequestID: ""},
		{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: "workspace", ID: "p"}}}, // no such kind
		{OrgID: "o", RequestID: "r", Scopes: []Scope{{Kind: KindKey, ID: "k", Budget: &Budget{CapMicros: 1, Window: "2w"}}}},
	} {
		_, err := b.lim.Admit(context.Background(), r)
		require.ErrorIs(t, err, ErrInvalidRequest, "%+v", r)
		// ValidateScopes refuses the scopes Admit refuses (a caller that
		// checks them once, Request.ScopesChecked) and accepts the rest.
		if err := ValidateScopes(r.Scopes); len(r.Scopes) > 0 {
			require.ErrorIs(t, err, ErrInvalidRequest, "%+v", r.Scopes)
		} else {
			require.NoError(t, err)
		}
		// The rest of the request is checked whatever ScopesChecked says.
		if len(r.Scopes) == 0 {
			r.ScopesChecked = true
			_, err = b.lim.Admit(context.Background(), r)
			require.ErrorIs(t, err, ErrInvalidRequest, "%+v", r)
		}
	}
	require.NoError(t, ValidateScopes([]Scope{{Kind: KindKey, ID: "k", RPM: 10, Budget: &Budget{CapMicros: 1, Window: "7d"}}, {Kind: KindOrg, ID: "o", MaxParallel: 3}}))
}

// TestBudgetWindowLuaMatchesGo checks that budget_window in lua/common.lua
// and BudgetWindow draw the same boundaries.
func TestBudgetWindowLuaMatchesGo(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	src := commonLua + "\nreturn {budget_window(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]))}"
	times := []time.Time{
		time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2024, 2, 29, 23, 59, 59, 0, time.UTC),
		time.Date(2025, 12, 31, 23, 59, 59, 0, time.UTC), time.Date(2100, 3, 1, 0, 0, 0, 0, time.UTC),
		time.Now(),
	}
	for _, w := range []string{"1h", "24h", "1d", "7d", "30d", "366d", "1mo", "3mo", "5mo", "12mo"} {
		for _, at := range times {
			u, err := budget.ParseWindow(w)
			require.NoError(t, err)
			v, err := b.rdb.Eval(context.Background(), src, nil, u.Unit, u.N, at.Unix()).Int64Slice()
			require.NoError(t, err)
			start, end, err := BudgetWindow(w, at)
			require.NoError(t, err)
			require.Equal(t, []int64{start.Unix(), end.Unix()}, v[1:], "%s at %v", w, at)
			require.False(t, at.Before(start) || !at.Before(end))
		}
	}
}

// BenchmarkAdmitSettle measures one Admit plus one Settle (two script round
// trips, four scopes) against a baseline of two PINGs (two bare round trips)
// on the same Redis in the same run.
func BenchmarkAdmitSettle(b *testing.B) {
	bb := setup(b, func(c *Config) { c.CallTimeout = time.Second })
	scopes := []Scope{
		{Kind: KindKey, ID: "k", RPM: 1e9, TPM: 1e12, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "30d"}},
		{Kind: KindTeam, ID: "t", RPM: 1e9, MaxParallel: 1e6, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
		{Kind: KindUser, ID: "u", Budget: &Budget{CapMicros: 1e15, Window: "1d"}},
		{Kind: KindOrg, ID: "o", TPM: 1e12, Budget: &Budget{CapMicros: 1e15, Window: "1mo"}},
	}
	ctx := context.Background()
	b.Run("baseline_2xPING", func(b *testing.B) {
		for b.Loop() {
			if err := bb.rdb.Ping(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			if err := bb.rdb.Ping(ctx).Err(); err != nil {
				b.Fatal(err)
			}
		}
	})
	var n atomic.Int64
	b.Run("admit_settle", func(b *testing.B) {
		for b.Loop() {
			d, err := bb.lim.Admit(ctx, bb.req(strconv.FormatInt(n.Add(1), 10), 100, 1000, scopes...))
			if err != nil || !d.Allowed {
				b.Fatalf("admit: %v %+v", err, d.Rejection)
			}
			if _, err := bb.lim.Settle(ctx, d.Lease, 80, 700); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("admit_settle_parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				d, err := bb.lim.Admit(ctx, bb.req(strconv.FormatInt(n.Add(1), 10), 100, 1000, scopes...))
				if err != nil || !d.Allowed {
					b.Fatalf("admit: %v %+v", err, d.Rejection)
				}
				if _, err := bb.lim.Settle(ctx, d.Lease, 80, 700); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
}

// TestWindowBookkeepingUnderChurn drives one tpm+rpm scope with random
// admissions, settlements (refunds to zero, under- and over-estimates),
// idle gaps longer than the window and inconsistent bookkeeping, checking
// after every step that the window's running total equals its buckets and
// that a pruned window never counts more than its limit.
func TestWindowBookkeepingUnderChurn(t *testing.T) {
	t.Parallel()
	const window, bucket = 300 * time.Millisecond, 10 * time.Millisecond
	b := setup(t, func(c *Config) { c.rateWindow, c.rateBucket = window, bucket })
	s := Scope{Kind: KindKey, ID: "k", RPM: 8, TPM: 400}
	ctx := context.Background()
	var live []*Lease
	admitted := 0
	for i := range 400 {
		switch {
		case i%97 == 0:
			time.Sleep(2 * window) // idle gap: the whole window leaves
		case i%7 == 0:
			time.Sleep(time.Duration(mathrand.IntN(30)) * time.Millisecond)
		}
		if len(live) > 0 && mathrand.IntN(2) == 0 {
			l := live[0]
			live = live[1:]
			_, err := b.lim.Settle(ctx, l, int64(mathrand.IntN(120)), 0) // 0..119 vs estimates 1..60
			require.NoError(t, err)
			_ = b.state(t, s) // checks 't' == sum of buckets
			continue
		}
		d := b.admit(t, b.req(fmt.Sprint("r", i), int64(1+mathrand.IntN(60)), 0, s))
		st := b.state(t, s)
		require.LessOrEqual(t, st.Requests, s.RPM, "step %d", i)
		if d.Allowed {
			admitted++
			live = append(live, d.Lease)
		} else {
			require.Positive(t, d.Rejection.RetryAfter)
			require.LessOrEqual(t, d.Rejection.RetryAfter, window+bucket)
		}
	}
	require.Greater(t, admitted, 20)

	// A window whose bookkeeping is inconsistent (a total without its
	// oldest bucket) is rebuilt from its buckets.
	time.Sleep(window + 2*bucket) // the tpm window empties
	k := newKeyBuilder(b.prefix, b.org).scope(&s)
	require.NoError(t, b.rdb.Del(ctx, k[0]).Err())
	require.NoError(t, b.rdb.HSet(ctx, k[0], "r1", 3, "rt", 3).Err()) // a stale bucket (1970)
	d := b.admit(t, b.req("legacy", 1, 0, s))
	require.True(t, d.Allowed)
	require.Equal(t, int64(1), b.state(t, s).Requests)
}

func TestSettleBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindTeam, ID: "t", TPM: 10_000, MaxParallel: 100, Budget: &Budget{CapMicros: 1e9, Window: "1d"}}
	rpmOnly := Scope{Kind: KindKey, ID: "k", RPM: 1000}
	var items []SettleItem
	for i := range 20 {
		d := b.admit(t, b.req(fmt.Sprint("r", i), 50, 1000, s))
		require.True(t, d.Allowed)
		items = append(items, SettleItem{Lease: d.Lease, Tokens: 10, CostMicros: 100})
	}
	d := b.admit(t, b.req("rpm-only", 0, 0, rpmOnly))
	items = append(items, SettleItem{Lease: d.Lease})
	require.Equal(t, scopeState{Tokens: 1000, Leases: 20, Spend: 20_000}, b.state(t, s))
	// Pipelined: the first ten.
	res, errs := b.lim.SettleBatch(ctx, items[:10])
	for i := range 10 {
		require.NoError(t, errs[i])
		require.True(t, res[i].Applied, "item %d", i)
	}
	require.Equal(t, scopeState{Tokens: 600, Leases: 10, Spend: 11_000}, b.state(t, s))
	// Scripts missing from Redis (restart, SCRIPT FLUSH) fall back to
	// loading them.
	require.NoError(t, b.rdb.ScriptFlush(ctx).Err())
	res, errs = b.lim.SettleBatch(ctx, items[10:])
	for i := range items[10:] {
		require.NoError(t, errs[i])
		require.True(t, res[i].Applied, "item %d", 10+i)
	}
	require.Equal(t, scopeState{Tokens: 200, Spend: 2000}, b.state(t, s))
	// Settled once: a second batch is a no-op.
	res, errs = b.lim.SettleBatch(ctx, items)
	for i := range items {
		require.NoError(t, errs[i])
		require.False(t, res[i].Applied)
	}
	require.Equal(t, scopeState{Tokens: 200, Spend: 2000}, b.state(t, s))
}

// TestCancelUndoesALateAdmission: an admission whose call failed (the
// caller answered 503) but ran in Redis anyway is cancelled: whichever of
// the two runs first, nothing stays consumed, its rpm unit included.
func TestCancelUndoesALateAdmission(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx := context.Background()
	s := Scope{Kind: KindKey, ID: "k", RPM: 10, TPM: 1000, MaxParallel: 5, Budget: &Budget{CapMicros: 1e6, Window: "1d"}}

	// The admission ran (late), then the cancellation.
	d := b.admit(t, b.req("late", 100, 500, s))
	require.True(t, d.Allowed)
	require.Equal(t, scopeState{Requests: 1, Tokens: 100, Leases: 1, Spend: 500}, b.state(t, s))
	res, err := b.lim.Cancel(ctx, d.Lease)
	require.NoError(t, err)
	require.True(t, res.Applied)
	require.Equal(t, scopeState{}, b.state(t, s), "nothing stays consumed")

	// The cancellation first (on a lease whose call never answered), then
	// the late admission: refused as a duplicate, consuming nothing.
	d2 := b.admit(t, b.req("other", 100, 500, s)) // a lease for the same scopes
	lease := &Lease{orgID: b.org, requestID: "early", keys: newKeyBuilder(b.prefix, b.org).callKeys("early", []Scope{s}),
		scopes: []Scope{s}, est: 100, reserved: 500, needs: true}
	_, err = b.lim.Cancel(ctx, lease)
	require.NoError(t, err)
	_, err = b.lim.Admit(ctx, b.req("early", 100, 500, s))
	require.ErrorIs(t, err, ErrDuplicateRequest)
	require.Equal(t, scopeState{Requests: 1, Tokens: 100, Leases: 1, Spend: 500}, b.state(t, s), "only the other request")
	_, err = b.lim.Settle(ctx, d2.Lease, 0, 0)
	require.NoError(t, err)

	// Batched cancellations too.
	d3 := b.admit(t, b.req("batched", 100, 500, s))
	res2, errs := b.lim.SettleBatch(ctx, []SettleItem{{Lease: d3.Lease, Cancel: true}, {Lease: d3.Lease, Cancel: true}})
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.True(t, res2[0].Applied)
	require.False(t, res2[1].Applied, "settled once")
	require.Equal(t, scopeState{Requests: 1}, b.state(t, s), "only the settled request's rpm unit")
}
