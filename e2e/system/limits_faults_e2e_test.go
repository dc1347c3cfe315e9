package system

import (
	"context"
	"math/rand/v2"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/internal/budget"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Fault-injection must-shows of issue 5 ("Redis faults", and the SIGKILL of
// a proxy process of "Exit paths"): real Redis (a redis-server of the
// test's own where the test hurts it), four data planes, and an upstream
// that counts what reaches it. The figures are logged (go test -v).

// lfPrices are the prices of the fault tests' deployment (USD per token).
var lfPrices = &adminv1.Prices{InputPerToken: 1e-4, OutputPerToken: 1e-3}

// lfCostMicros is the real cost of every request of these tests: the fake
// upstream reports the same usage for all.
var lfCostMicros = budget.Micros(lfPromptTokens*lfPrices.InputPerToken + lfCompletionTokens*lfPrices.OutputPerToken)

// Limits-store faults of TestLimitsRedis{Killed,Stopped}FailsClosed.
const (
	lfKill = "SIGKILL"
	lfStop = "SIGSTOP"
)

// Bounds the issue states.
const (
	lfRejectP99Bound = 150 * time.Millisecond
	lfResumeBound    = 3 * time.Second
)

// TestLimitsRedisKilledFailsClosed: SIGKILL of the limits store mid-run →
// no admission of budget-, concurrency- or (fallback closed) rpm-limited
// keys, 503 limits_unavailable within 150 ms p99; after a restart
// admissions resume.
func TestLimitsRedisKilledFailsClosed(t *testing.T) {
	lfRedisFault(t, lfKill, false)
}

// TestLimitsRedisKilledFailsClosedSlices is TestLimitsRedisKilledFailsClosed
// with quota slices on (--limit-slices): the budget and rpm keys are
// admitted from slices until the kill; a data plane stops using them at
// once (its connection breaks), at the latest one slice tick plus the call
// timeout after it (lfSliceGrace), and fails closed from then on.
func TestLimitsRedisKilledFailsClosedSlices(t *testing.T) {
	lfRedisFault(t, lfKill, true)
}

// TestLimitsRedisStoppedFailsClosed: SIGSTOP of the limits store (the
// kernel still accepts connections, nothing answers) → the same within the
// 50 ms per-call timeout; SIGCONT → admissions resume. Admissions that
// timed out yet ran in Redis after SIGCONT ("ghosts") must leave no budget
// reservation and no lease behind (the proxy cancels them).
func TestLimitsRedisStoppedFailsClosed(t *testing.T) {
	lfRedisFault(t, lfStop, false)
}

// TestLimitsRedisStoppedFailsClosedSlices is TestLimitsRedisStoppedFailsClosed
// with quota slices on: no request sent more than lfSliceGrace after the
// SIGSTOP is admitted (a data plane uses slices only while Redis answered
// a call sent less than a tick plus the call timeout ago).
func TestLimitsRedisStoppedFailsClosedSlices(t *testing.T) {
	lfRedisFault(t, lfStop, true)
}

// lfSliceGrace is how long after Redis stops answering a data plane with
// quota slices may still admit from them: one slice tick (its heartbeat)
// plus the call timeout, which exact admission waits before failing.
// (limits.DefaultSliceTick and DefaultCallTimeout, 50 ms each).
const lfSliceGrace = 100 * time.Millisecond

// lfRedisFault runs load on three keys over four data planes sharing a
// dedicated redis-server, hurts it (fault), heals it and checks what the
// upstream and the clients saw. It is not parallel: it asserts a latency
// bound. With sliced, the data planes run with quota slices: requests
// sent within lfSliceGrace of the fault may still be admitted from them.
func lfRedisFault(t *testing.T, fault string, sliced bool) {
	const (
		preFault  = 2 * time.Second
		outage    = 3 * time.Second
		streamDur = 300 * time.Millisecond
		workers   = 4 // per key
		concCap   = 3
	)
	// After SIGCONT, admissions that timed out during the freeze run in
	// Redis anyway (lfGhosts measures them): their leases hold slots until
	// the lease TTL, so the frozen run uses a short one to keep the test
	// short.
	leaseTTL := time.Duration(0) // default (30 s)
	if fault == lfStop {
		leaseTTL = 8 * time.Second
	}
	lfQuietRedisLog()
	rs := lfStartRedis(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	var proxies []*proxy
	for range 4 {
		proxies = append(proxies, d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
			c.RedisURL, c.LeaseTTL, c.NoLimitSlices = rs.url(), leaseTTL, !sliced
		}))
	}
	org := lfOrg(t, d, "faults")
	team := lfTeam(t, d, org, "team", nil)
	type keyClass struct{ class, id, tok string }
	var keys []keyClass
	for _, k := range []struct {
		class string
		l     *adminv1.Limits
	}{
		{"conc", &adminv1.Limits{MaxParallelRequests: proto.Int64(concCap)}},
		{"budget", &adminv1.Limits{MaxBudget: proto.Float64(1000), BudgetDuration: "1d"}},
		{"rpm", &adminv1.Limits{RpmLimit: proto.Int64(100_000)}},
	} {
		id, tok := lfKey(t, d, org, team, k.l)
		keys = append(keys, keyClass{k.class, id, tok})
	}
	c := lfNewClient(t)
	for _, k := range keys {
		lfWaitAdmitted(t, c, proxies, k.tok, k.class)
	}

	ctx, stopLoad := context.WithCancel(context.Background())
	defer stopLoad()
	wait := lfWorkers(ctx, workers*len(keys), func(ctx context.Context, w int) {
		k := keys[w%len(keys)]
		i := (w/len(keys) + int(c.seq.Load())) % len(proxies)
		r := c.do(context.Background(), proxies[i].URL, i, k.tok, k.class, streamDur, true)
		lfPause(ctx, r, 5*time.Millisecond, 100*time.Millisecond)
	})
	time.Sleep(preFault)
	var down time.Time
	if fault == lfKill {
		down = rs.kill()
	} else {
		down = rs.stop()
	}
	time.Sleep(outage)
	healed := time.Now()
	if fault == lfKill {
		rs.start()
	} else {
		rs.cont()
	}
	resumeWithin := 10 * time.Second
	if fault == lfStop {
		resumeWithin = leaseTTL + 5*time.Second
	}
	resumed := map[string]time.Duration{}
	ok := harness.Until(func() bool {
		for _, k := range keys {
			if at, ok := c.first200After(k.class, healed); ok {
				resumed[k.class] = at.Sub(healed)
			}
		}
		return len(resumed) == len(keys)
	}, resumeWithin, 50*time.Millisecond)

	time.Sleep(500 * time.Millisecond)
	stopLoad()
	wait()
	require.True(t, ok, "admissions did not resume within %s of the %s's end: %v", resumeWithin, fault, resumed)

	all := c.results()
	byID := map[string]lfRes{}
	for _, r := range all {
		byID[r.id] = r
	}
	var rejected []lfRes
	pre, preLimited := map[string]int{}, map[string]int{}
	// cut: requests sent before it may have been admitted (with slices,
	// within the grace after the fault).
	cut, graced := down, 0
	if sliced {
		cut = down.Add(lfSliceGrace)
	}
	for _, r := range all {
		if r.start.Before(down) && r.status == http.StatusOK {
			pre[r.class]++
		}
		if r.start.Before(down) && r.status == http.StatusTooManyRequests {
			preLimited[r.class]++
		}
		// Requests sent and answered while the store was down.
		if r.start.Before(down) || !r.done.Before(healed) {
			continue
		}
		if r.start.Before(cut) && r.status == http.StatusOK {
			graced++ // from a slice, within the grace
			continue
		}
		require.NoError(t, r.err, "request %s", r.id)
		require.Equal(t, http.StatusServiceUnavailable, r.status, "request %s sent %s after the %s: %d %s",
			r.id, r.start.Sub(down), fault, r.status, r.code)
		require.Equal(t, dataplane.CodeLimitsUnavailable, r.code, "request %s", r.id)
		rejected = append(rejected, r)
	}
	for _, k := range keys {
		require.Positive(t, pre[k.class], "no %s request admitted before the %s", k.class, fault)
		// The upstream saw no request of this key that was sent while the
		// store was down; what it received then was admitted before.
		late := 0
		for id, at := range up.class(k.class).arrivalsBetween(down, healed) {
			r, ok := byID[id]
			require.True(t, ok, "upstream saw unknown request %s", id)
			require.True(t, r.start.Before(cut), "%s request %s sent %s after the %s reached the upstream %s after it",
				k.class, id, r.start.Sub(down), fault, at.Sub(down))
			late++
		}
		t.Logf("%s key: %d admitted (%d limited 429) before the %s, %d of them reached the upstream after it (admitted before), resumed %s after the %s ended",
			k.class, pre[k.class], preLimited[k.class], fault, late, resumed[k.class].Round(time.Millisecond), fault)
	}
	if sliced {
		t.Logf("quota slices on: %d requests sent within %s of the %s admitted from slices; none sent later", graced, lfSliceGrace, fault)
	}
	require.GreaterOrEqual(t, len(rejected), 100, "too few rejections to measure a p99")
	p50, p99, pmax := lfP(rejected, 50), lfP(rejected, 99), lfP(rejected, 100)
	t.Logf("%s: %d requests refused 503 limits_unavailable during a %s outage (0 admitted); client latency p50 %s, p99 %s, max %s (bound p99 ≤ %s)",
		fault, len(rejected), outage, p50.Round(100*time.Microsecond), p99.Round(100*time.Microsecond), pmax.Round(100*time.Microsecond), lfRejectP99Bound)
	for _, k := range keys {
		var own []lfRes
		for _, r := range rejected {
			if r.class == k.class {
				own = append(own, r)
			}
		}
		require.NotEmpty(t, own, "no %s request during the outage", k.class)
		t.Logf("  %s key: %d refused, p99 %s", k.class, len(own), lfP(own, 99).Round(100*time.Microsecond))
	}
	require.LessOrEqual(t, p99, lfRejectP99Bound, "p99 of the rejections while the store is down")

	if fault == lfStop {
		lfGhosts(t, rs, proxies, d.RedisPrefix, org, keys[0].id, keys[1].id, keys[2].id, up, sliced)
	}
}

// lfGhosts measures, once every request has ended and settled, what the
// admissions that timed out while Redis was frozen left behind: Redis ran
// them when it resumed, although their proxies had already answered 503
// and forwarded nothing. Every request of a class that reached the
// upstream consumed one rpm unit and settled its budget reservation to the
// real cost, so any excess is a ghost admission.
//
// With sliced, the budget key was admitted from budget slices: what
// carves that timed out during the freeze took is lost to the window
// (docs/limits.md, "Quota slices"), so its spend is only checked not to
// be below the real cost.
func lfGhosts(t *testing.T, rs *lfRedis, proxies []*proxy, prefix, org, concKey, budgetKey, rpmKey string, up *lfUpstream, sliced bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for _, p := range proxies {
		require.NoError(t, p.DP.Drain(ctx))
	}
	rdb := rs.client()
	base := prefix + "{o:" + org + "}:"
	var rpmSum int64
	vals, err := rdb.HGetAll(ctx, base+"lim:key:"+rpmKey).Result()
	require.NoError(t, err)
	for f, v := range vals {
		if !strings.HasPrefix(f, "r") || f == "rt" || f == "ro" { // the requests window's buckets only
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		rpmSum += n
	}
	rpmUp := up.class("rpm").total.Load()
	spend, err := rdb.HGet(ctx, base+"lim:key:"+budgetKey, "bs").Int64()
	require.NoError(t, err)
	budUp := up.class("budget").total.Load()
	leases, err := rdb.ZCount(ctx, base+"par:key:"+concKey, strconv.FormatInt(time.Now().UnixMilli(), 10), "+inf").Result()
	require.NoError(t, err)
	t.Logf("ghost admissions (admissions that timed out, answered 503, and ran in Redis after SIGCONT) — after SIGCONT and drain: rpm key counted %d admissions for %d forwarded (%d ghost); budget key spend %d µUSD for %d forwarded × %d µUSD = %d (excess %d µUSD of never-settled reservations); concurrency key holds %d leases with no request in flight (upstream in flight %d)",
		rpmSum, rpmUp, rpmSum-rpmUp, spend, budUp, lfCostMicros, budUp*lfCostMicros, spend-budUp*lfCostMicros,
		leases, up.class("conc").inFlight.Load())
	require.GreaterOrEqual(t, rpmSum, rpmUp, "rpm counted fewer admissions than reached the upstream")
	// Timed-out admissions are cancelled (settled with zero usage): a late
	// execution keeps no budget reservation and no lease. Its rpm unit is
	// not given back (documented).
	if sliced {
		require.GreaterOrEqual(t, spend, budUp*lfCostMicros, "budget spend below the real cost of what reached the upstream")
	} else {
		require.Equal(t, budUp*lfCostMicros, spend, "budget spend equals the real cost of what reached the upstream: no ghost reservation")
	}
	require.Equal(t, up.class("conc").inFlight.Load(), leases, "no ghost lease")
}

// TestLimitsRedisRestartedEmpty: a team cap of N over four data planes with
// 1–3 s streams and about twice the offered load; Redis is killed and a
// fresh, empty one started on the same port mid-run. The upstream never
// sees more than N of the team in flight (live requests re-assert their
// leases during the epoch quarantine) and new requests are admitted again
// within 3 s of the restart. A budget counter lost with Redis restarts
// from its seed (the ledger's spend, answered by the control plane when
// the data plane asks), not from zero.
func TestLimitsRedisRestartedEmpty(t *testing.T) {
	const (
		capN      = 20
		workers   = 36
		preKill   = 4 * time.Second
		postWatch = 4 * time.Second
		seedReqs  = 10
	)
	lfQuietRedisLog()
	rs := lfStartRedis(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	var proxies []*proxy
	for range 4 {
		proxies = append(proxies, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RedisURL = rs.url() }))
	}
	org := lfOrg(t, d, "restart")
	team := lfTeam(t, d, org, "capped", &adminv1.Limits{MaxParallelRequests: proto.Int64(capN)})
	_, tok := lfKey(t, d, org, team, nil)
	other := lfTeam(t, d, org, "budgeted", nil)
	budKey, budTok := lfKey(t, d, org, other, &adminv1.Limits{MaxBudget: proto.Float64(100), BudgetDuration: "1d"})
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, proxies, tok, "team")
	lfWaitAdmitted(t, c, proxies, budTok, "bud")

	// Spend on the budgeted key, then wait until the ledger has it.
	for i := range seedReqs {
		r := c.do(context.Background(), proxies[i%4].URL, i%4, budTok, "bud", 0, false)
		require.Equal(t, http.StatusOK, r.status, "%s", r.code)
	}
	dctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	for _, p := range proxies {
		require.NoError(t, p.DP.Drain(dctx))
	}
	cancel()
	budRedisKey := d.RedisPrefix + "{o:" + org + "}:lim:key:" + budKey
	before, err := rs.client().HGet(context.Background(), budRedisKey, "bs").Int64()
	require.NoError(t, err)
	budReqs := up.class("bud").total.Load()
	require.Zero(t, before%budReqs, "budget counter %d µUSD before the restart is not %d equal real costs", before, budReqs)
	perReq := before / budReqs
	require.InDelta(t, lfCostMicros, perReq, 1, "real cost of one request (µUSD)")
	ok := harness.Until(func() bool { return d.ledgerKeyPaid(t, budKey) == int(budReqs) }, 30*time.Second, 50*time.Millisecond)
	require.True(t, ok, "the ledger holds %d of the %d requests of the budgeted key", d.ledgerKeyPaid(t, budKey), budReqs)
	// The seed the data plane will get: the key's spend today in Postgres
	// (spend_daily, what a 1d window's seed sums). The data plane charges
	// each request its cost rounded up to the µUSD; the ledger sums exact
	// costs: ≤ 1 µUSD apart per request.
	_, seed := d.ledgerKeyMicros(t, budKey)
	require.InDelta(t, before, seed, float64(budReqs), "ledger spend vs the Redis counter before the restart")

	// Saturate the team.
	ctx, stopLoad := context.WithCancel(context.Background())
	defer stopLoad()
	var measuring atomic.Bool
	measuring.Store(true)
	team1 := up.class("team")
	wait := lfWorkers(ctx, workers, func(ctx context.Context, w int) {
		i := (w + int(c.seq.Load())) % len(proxies)
		dur := time.Second + time.Duration(rand.Int64N(int64(2*time.Second)))
		r := c.do(context.Background(), proxies[i].URL, i, tok, "team", dur, true)
		if r.status == http.StatusOK && r.err != nil && measuring.Load() {
			t.Errorf("stream %s broke: %v", r.id, r.err)
		}
		lfPause(ctx, r, 20*time.Millisecond, 100*time.Millisecond)
	})
	// Sample the team's in flight at the upstream.
	type sample struct {
		at time.Time
		n  int64
	}
	var samples []sample
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for measuring.Load() {
			samples = append(samples, sample{time.Now(), team1.inFlight.Load()})
			time.Sleep(2 * time.Millisecond)
		}
	}()
	require.True(t, harness.Until(func() bool { return team1.inFlight.Load() == capN }, 15*time.Second, 50*time.Millisecond),
		"the team never reached its cap of %d in flight (in flight %d)", capN, team1.inFlight.Load())
	saturated := time.Now()
	time.Sleep(preKill)
	killed := rs.kill()
	restarted := time.Now()
	rs.start()
	ready := time.Now()
	var resumedAt time.Time
	ok = harness.Until(func() bool {
		var ok bool
		resumedAt, ok = c.first200After("team", restarted)
		return ok
	}, 10*time.Second, 50*time.Millisecond)

	require.True(t, ok, "no new request of the team admitted within 10 s of the restart")
	// The budget counter, lost with Redis, restarts from the ledger's
	// spend. One request is served (a 503 while the loaded store or the
	// seed round trip misses a deadline charges nothing; it is retried).
	var r lfRes
	ok = harness.Until(func() bool {
		r = c.do(context.Background(), proxies[1].URL, 1, budTok, "bud", 0, false)
		if r.status != http.StatusOK {
			require.Equal(t, http.StatusServiceUnavailable, r.status, "%s", r.code)
		}
		return r.status == http.StatusOK
	}, 10*time.Second, 50*time.Millisecond)

	require.True(t, ok, "the budgeted key was not served after the restart: %d %s", r.status, r.code)
	time.Sleep(postWatch)
	measuring.Store(false)
	<-sampled
	stopLoad()
	wait()
	dctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, p := range proxies {
		require.NoError(t, p.DP.Drain(dctx))
	}
	after, err := rs.client().HGet(context.Background(), budRedisKey, "bs").Int64()
	require.NoError(t, err)

	mean := func(from, to time.Time) (float64, int64) {
		var sum, n, peak int64
		for _, s := range samples {
			if !s.at.Before(from) && s.at.Before(to) {
				sum += s.n
				n++
				peak = max(peak, s.n)
			}
		}
		if n == 0 {
			return 0, 0
		}
		return float64(sum) / float64(n), peak
	}
	preMean, prePeak := mean(saturated, killed)
	gapMean, gapPeak := mean(killed, resumedAt)
	postMean, postPeak := mean(resumedAt.Add(time.Second), resumedAt.Add(postWatch))
	var rejected, admitted, recovering, unavailable int
	for _, r := range c.results() {
		if r.class != "team" || r.start.Before(saturated) {
			continue
		}
		switch {
		case r.status == http.StatusOK:
			admitted++
		case r.code == dataplane.CodeConcurrencyLimitExceeded:
			rejected++
		case r.code == dataplane.CodeLimitsRecovering:
			recovering++
		case r.code == dataplane.CodeLimitsUnavailable:
			unavailable++
		}
	}
	resume := resumedAt.Sub(restarted)
	t.Logf("team cap %d, %d clients, 1–3 s streams over 4 data planes: upstream peak in flight %d (exact), sampled peak before/during/after the restart %d/%d/%d",
		capN, workers, team1.peak.Load(), prePeak, gapPeak, postPeak)
	t.Logf("utilisation (mean in flight ÷ cap): %.1f %% saturated before the kill, %.1f %% from kill to resume, %.1f %% from 1 s after resume",
		100*preMean/capN, 100*gapMean/capN, 100*postMean/capN)
	t.Logf("restart: new redis-server answering %s after exec; first new request admitted %s after the restart (bound %s); after saturation %d admitted, %d concurrency_limit_exceeded, %d limits_recovering, %d limits_unavailable",
		ready.Sub(restarted).Round(time.Millisecond), resume.Round(time.Millisecond), lfResumeBound, admitted, rejected, recovering, unavailable)
	t.Logf("budget key: counter %d µUSD before the restart, ledger spend %d µUSD, %d µUSD after it and one more request (a reset would give about %d)",
		before, seed, after, perReq)
	require.LessOrEqual(t, team1.peak.Load(), int64(capN), "the upstream saw more of the team in flight than its cap")
	require.LessOrEqual(t, resume, lfResumeBound, "admissions resumed too late after the restart")
	require.Positive(t, recovering, "no quarantine rejection seen: was the state loss detected?")
	require.GreaterOrEqual(t, after, seed, "the budget counter restarted below the ledger's spend")
	require.Equal(t, seed+perReq, after, "budget counter after the restart = the ledger's spend + the one request since")
}

// TestLimitsProxySIGKILLReleasesSlots: a real `sluice proxy` process holds
// every slot of a key (max_parallel_requests = K) with K streams and is
// SIGKILLed; an in-process data plane admits the key again once the dead
// process's leases expire: within lease TTL + one renew interval (+ margin),
// and not before TTL − one renew interval (the slots really were held).
func TestLimitsProxySIGKILLReleasesSlots(t *testing.T) {
	t.Parallel()
	const (
		k        = 3
		leaseTTL = 5 * time.Second
		renew    = time.Second // limits.DefaultRenewInterval
		margin   = time.Second
	)
	bin := lfBuildSluice(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "sigkill")
	team := lfTeam(t, d, org, "team", nil)
	_, tok := lfKey(t, d, org, team, &adminv1.Limits{MaxParallelRequests: proto.Int64(k)})
	in := d.StartProxy("default", time.Minute)
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, []*proxy{in}, tok, "poll")

	addr := "127.0.0.1:" + strconv.Itoa(lfFreePort(t))
	logs := &lfLogBuf{}
	cmd := exec.Command(bin, "proxy", "--addr", addr, "--region", "default", "--nats-url", d.NATS.URL,
		"--redis-url", d.RedisURL, "--redis-key-prefix", d.RedisPrefix, "--lease-ttl", leaseTTL.String())
	cmd.Env = lfEnv("SLUICE_KEY_PEPPER="+testPepper, "SLUICE_KEK="+testKEK)
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	sub := &proxy{URL: "http://" + addr}
	ok := harness.Until(func() bool {
		resp, err := http.Get(sub.URL + "/readyz")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond)

	require.True(t, ok, "sluice proxy never ready; its log:\n%s", logs)

	// K streams through the subprocess hold every slot.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hold := up.class("hold")
	for range k {
		go func() {
			for ctx.Err() == nil {
				r := c.do(ctx, sub.URL, -1, tok, "hold", time.Minute, true)
				if r.status == http.StatusOK {
					return // the stream ran until the process died
				}
				lfPause(ctx, r, 20*time.Millisecond, 100*time.Millisecond)
			}
		}()
	}
	require.True(t, harness.Until(func() bool { return hold.inFlight.Load() == k }, 20*time.Second, 50*time.Millisecond),
		"the subprocess never held %d streams (upstream in flight %d); its log:\n%s", k, hold.inFlight.Load(), logs)
	r := c.do(context.Background(), in.URL, 0, tok, "poll", 0, false)
	require.Equal(t, http.StatusTooManyRequests, r.status, "the in-process proxy admitted beyond the cap: %s", r.code)
	require.Equal(t, dataplane.CodeConcurrencyLimitExceeded, r.code)
	require.Equal(t, "parallel", r.limitType)
	time.Sleep(2500 * time.Millisecond) // a few renewals by the subprocess

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	<-exited
	killed := time.Now()
	var admitted time.Time
	polls := 0
	ok = harness.Until(func() bool {
		polls++
		r := c.do(context.Background(), in.URL, 0, tok, "poll", 0, false)
		if r.status == http.StatusOK {
			admitted = r.hdr
			return true
		}
		require.Equal(t, dataplane.CodeConcurrencyLimitExceeded, r.code, "poll answered %d", r.status)
		return false
	}, 20*time.Second, 50*time.Millisecond)

	require.True(t, ok, "the dead proxy's slots never came back")
	back := admitted.Sub(killed)
	lo, hi := leaseTTL-renew-margin/2, leaseTTL+renew+margin
	t.Logf("K=%d slots held by a SIGKILLed sluice proxy (lease TTL %s, renew every %s): first admission through another data plane %s after the kill (%d polls); allowed window [%s, %s]",
		k, leaseTTL, renew, back.Round(time.Millisecond), polls, lo, hi)
	require.GreaterOrEqual(t, back, lo, "slots came back before the lease TTL: were they held?")
	require.LessOrEqual(t, back, hi, "slots came back later than lease TTL + one heartbeat")
	// Every slot comes back, not just one: K streams at once are admitted.
	ok = harness.Until(func() bool {
		res := make(chan int, k)
		for range k {
			go func() { res <- c.do(context.Background(), in.URL, 0, tok, "poll", 300*time.Millisecond, true).status }()
		}
		n := 0
		for range k {
			if <-res == http.StatusOK {
				n++
			}
		}
		return n == k
	}, 3*time.Second, 50*time.Millisecond)

	require.True(t, ok, "not every slot came back")
}
