package system

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/internal/budget"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// Must-shows of issue 19, item 4 ("a Redis restart resets budgets to a
// stale seed"): after Redis loses its keys, a budget is re-seeded from the
// ledger's current totals before anything is admitted.

// seedPrices are powers of two, so that every request costs exactly
// 10·2⁻¹⁴ + 8·2⁻¹⁰ = 0.0084228515625 USD and every sum of costs is exact
// in floating point: the ledger's totals (spend_logs, spend_daily) and the
// seed then agree to the micro-dollar, whatever the order of summation.
var seedPrices = &adminv1.Prices{InputPerToken: 1.0 / (1 << 14), OutputPerToken: 1.0 / (1 << 10)}

// ledgerKeyMicros returns a key's spend today (UTC) as Postgres holds it,
// from spend_logs and from spend_daily (which a seed of a 1d window
// reads), in micro-USD rounded up as seeds are.
func (d *dist) ledgerKeyMicros(t testing.TB, keyID string) (logs, daily int64) {
	t.Helper()
	day := time.Now().UTC().Truncate(24 * time.Hour)
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		var l, dl float64
		require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(sum(cost_usd::numeric), 0)::double precision FROM spend_logs
			WHERE key_id = $1 AND at >= $2 AND at < $3`, keyID, day, day.Add(24*time.Hour)).Scan(&l))
		require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(sum(cost_usd::numeric), 0)::double precision FROM spend_daily
			WHERE scope = 'key' AND scope_id = $1 AND day = $2`, keyID, day).Scan(&dl))
		logs, daily = budget.Micros(l), budget.Micros(dl)
	})
	return logs, daily
}

// ledgerKeyPaid counts the ledger rows of a key's requests that cost
// something (the served ones).
func (d *dist) ledgerKeyPaid(t testing.TB, keyID string) int {
	t.Helper()
	var n int
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM spend_logs WHERE key_id = $1 AND cost_usd > 0`, keyID).Scan(&n))
	})
	return n
}

// TestBudgetReseededFromLedgerAfterRedisLoss: two keys of $0.04 a day over
// two data planes sharing a dedicated redis-server. Key A is exhausted;
// key B spends some, a snapshot is compiled, then B spends the rest of its
// cap after that snapshot (a seed taken from it would be too low and
// admit B again). Redis is SIGKILLed and restarted empty. With the control
// plane down, nothing of either key is admitted (503 limits_recovering:
// the windows cannot be seeded) and Redis holds no budget window; with it
// back, A's seed equals its spend in Postgres and A answers 429
// budget_exceeded; then a concurrent burst on B over both data planes is
// refused whole, and B's seed equals its spend in Postgres, the
// post-snapshot spend included. The upstream sees no request of either key
// after the kill.
func TestBudgetReseededFromLedgerAfterRedisLoss(t *testing.T) {
	t.Parallel()
	const (
		capUSD = 0.04
		burst  = 40
	)
	capMicros := budget.Micros(capUSD)
	lfQuietRedisLog()
	rs := lfStartRedis(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, seedPrices)
	var proxies []*proxy
	for range 2 {
		proxies = append(proxies, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RedisURL = rs.url() }))
	}
	org := lfOrg(t, d, "reseed")
	team := lfTeam(t, d, org, "t", nil)
	lim := &adminv1.Limits{MaxBudget: proto.Float64(capUSD), BudgetDuration: "1d"}
	keyA, tokA := lfKey(t, d, org, team, lim)
	keyB, tokB := lfKey(t, d, org, team, lim)
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, proxies, tokA, "a")
	lfWaitAdmitted(t, c, proxies, tokB, "b")
	served := func(class string) (n int) {
		for _, r := range c.results() {
			if r.class == class && r.status == http.StatusOK {
				n++
			}
		}
		return n
	}
	// ledgerHas waits until the ledger recorded every served request of
	// class.
	ledgerHas := func(key, class string) {
		t.Helper()
		ok := harness.Until(func() bool { return d.ledgerKeyPaid(t, key) == served(class) }, 20*time.Second, 50*time.Millisecond)
		require.True(t, ok, "the ledger holds %d paid rows of %s, %d requests were served", d.ledgerKeyPaid(t, key), class, served(class))
	}
	// exhaust sends requests one by one, each settled before the next (a
	// reservation is several requests' real cost), until the cap answers.
	exhaust := func(tok, class string) {
		t.Helper()
		for i := 0; ; i++ {
			require.Less(t, i, 20, "the cap never answered")
			for _, p := range proxies {
				require.NoError(t, p.DP.Drain(context.Background()))
			}
			r := c.do(context.Background(), proxies[i%2].URL, i%2, tok, class, 0, false)
			if r.status == http.StatusTooManyRequests {
				require.Equal(t, dataplane.CodeBudgetExceeded, r.code)
				return
			}
			require.Equal(t, http.StatusOK, r.status, "%s %v", r.code, r.err)
		}
	}
	exhaust(tokA, "a")

	// B: the spend of the last snapshot, then more after it.
	ledgerHas(keyB, "b")
	v0 := proxies[0].DP.Catalog().Version
	lfTeam(t, d, org, "tick", nil) // a change compiles a snapshot
	for _, p := range proxies {
		require.True(t, harness.Until(func() bool { return p.DP.Catalog().Version > v0 }, 20*time.Second, 50*time.Millisecond),
			"no new snapshot reached the data plane")
	}
	atSnapshot, _ := d.ledgerKeyMicros(t, keyB)
	exhaust(tokB, "b")
	ledgerHas(keyA, "a")
	ledgerHas(keyB, "b")
	ledgerA, dailyA := d.ledgerKeyMicros(t, keyA)
	ledgerB, dailyB := d.ledgerKeyMicros(t, keyB)
	require.Equal(t, ledgerA, dailyA, "spend_logs and spend_daily agree on A")
	require.Equal(t, ledgerB, dailyB, "spend_logs and spend_daily agree on B")
	require.GreaterOrEqual(t, ledgerA, capMicros)
	require.GreaterOrEqual(t, ledgerB, capMicros)
	require.Less(t, atSnapshot, capMicros, "a seed from the last snapshot would admit B again")
	upA, upB := up.class("a").total.Load(), up.class("b").total.Load()

	rs.kill()
	rs.start()
	killedAt := time.Now()

	// The control plane is down: no seed can be had, nothing is admitted.
	for _, stop := range d.Controls {
		stop()
	}
	nc, err := nats.Connect(d.NATS.URL)
	require.NoError(t, err)
	defer nc.Close()
	require.True(t, harness.Until(func() bool {
		_, err := nc.Request(wire.BudgetSeedSubject, nil, time.Second)
		return errors.Is(err, nats.ErrNoResponders)
	}, 20*time.Second, 50*time.Millisecond),

		"the control plane still answers seed requests")
	var recovering int
	for i := range 10 {
		for _, k := range []struct{ tok, class string }{{tokA, "a"}, {tokB, "b"}} {
			r := c.do(context.Background(), proxies[i%2].URL, i%2, k.tok, k.class, 0, false)
			require.Equal(t, http.StatusServiceUnavailable, r.status, "%s admitted while its budget could not be seeded: %s", k.class, r.code)
			require.Contains(t, []string{dataplane.CodeLimitsRecovering, dataplane.CodeLimitsUnavailable}, r.code)
			if r.code == dataplane.CodeLimitsRecovering {
				recovering++
			}
		}
	}
	require.Positive(t, recovering, "no limits_recovering answer: was the missing window noticed?")
	rdb := rs.client()
	stateKey := func(key string) string { return d.RedisPrefix + "{o:" + org + "}:lim:key:" + key }
	for _, k := range []string{keyA, keyB} {
		has, err := rdb.HExists(context.Background(), stateKey(k), "bw").Result()
		require.NoError(t, err)
		require.False(t, has, "a budget window started without a seed")
	}

	// The control plane is back: A is re-seeded from the ledger and
	// rejected by its cap.
	d.StartControl("cp-2")
	var last lfRes
	ok := harness.Until(func() bool {
		last = c.do(context.Background(), proxies[0].URL, 0, tokA, "a", 0, false)
		require.NotEqual(t, http.StatusOK, last.status, "A admitted after the restart")
		return last.status == http.StatusTooManyRequests
	}, 30*time.Second, 50*time.Millisecond)

	require.True(t, ok, "A never answered budget_exceeded after the restart: %d %s", last.status, last.code)
	require.Equal(t, dataplane.CodeBudgetExceeded, last.code)
	seedA, err := rdb.HGet(context.Background(), stateKey(keyA), "bs").Int64()
	require.NoError(t, err)
	require.Equal(t, ledgerA, seedA, "A's seed is its spend in Postgres")

	// A burst on B over both data planes: every request refused.
	var wg sync.WaitGroup
	res := make([]lfRes, burst)
	for i := range burst {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i] = c.do(context.Background(), proxies[i%2].URL, i%2, tokB, "b", 0, false)
		}()
	}
	wg.Wait()
	codes := map[string]int{}
	for _, r := range res {
		require.NotEqual(t, http.StatusOK, r.status, "B admitted after the restart")
		codes[fmt.Sprint(r.status, " ", r.code)]++
	}
	require.Positive(t, codes["429 "+dataplane.CodeBudgetExceeded], "codes %v", codes)
	seedB, err := rdb.HGet(context.Background(), stateKey(keyB), "bs").Int64()
	require.NoError(t, err)
	require.Equal(t, ledgerB, seedB, "B's seed is its spend in Postgres, the spend after the last snapshot included")

	require.Equal(t, upA, up.class("a").total.Load(), "the upstream saw a request of A after the kill")
	require.Equal(t, upB, up.class("b").total.Load(), "the upstream saw a request of B after the kill")
	require.Empty(t, up.class("a").arrivalsBetween(killedAt, time.Now()))
	t.Logf("cap %d µUSD; A: ledger %d µUSD, seed %d; B: ledger %d µUSD at the last snapshot, %d at the kill, seed %d; "+
		"after the kill: %d limits_recovering with the control plane down, burst of %d on B: %v; upstream requests of A/B: %d/%d before, none after",
		capMicros, ledgerA, seedA, atSnapshot, ledgerB, seedB, recovering, burst, codes, upA, upB)
}
