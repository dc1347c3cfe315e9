package system

import (
	"context"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Issue 15's must-shows for quota slices through real data planes (the
// limiter's own tests, TestSlices* in dataplane/internal/limits, show the
// same in process). Every data plane here runs with slices set explicitly
// on (Config.NoLimitSlices false, --limit-slices), whatever the default is.

// slLeases reads a scope's lease set in the machine's Redis: the live
// members (score = expiry ms > now) that are quota-slice members
// (~<instance>:<n>) and those that are requests' own leases (exact
// admissions).
type slLeases struct {
	rdb *redis.Client
	key string
}

func newSLLeases(t testing.TB, d *dist, org, keyID string) *slLeases {
	rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
	t.Cleanup(func() { _ = rdb.Close() })
	return &slLeases{rdb: rdb, key: d.RedisPrefix + "{o:" + org + "}:par:key:" + keyID}
}

func (l *slLeases) live(t testing.TB) (slices, exact int) {
	now := strconv.FormatInt(time.Now().UnixMilli(), 10)
	ms, err := l.rdb.ZRangeArgs(context.Background(), redis.ZRangeArgs{Key: l.key, ByScore: true, Start: "(" + now, Stop: "+inf"}).Result()
	if err != nil {
		t.Errorf("read the lease set %s: %v", l.key, err) // also called off the test goroutine
		return 0, 0
	}
	for _, m := range ms {
		if strings.HasPrefix(m, "~") {
			slices++
		} else {
			exact++
		}
	}
	return slices, exact
}

// TestLimitsSlicesParallelAcrossThresholdNeverOverAdmits is the
// "a scope moving from slices to exact mode and back under load never
// over-admits" must-show through real data planes: a key with
// max_parallel_requests 40 (sliced: ≥ MinParallel) is driven from three
// sliced data planes at 9, then 60, then 9 clients of 300 ms streams. The
// first and last phases are served from slices (slots in use from slices,
// no exact lease needed); the middle one takes the scope to its cap, where
// the last 10 % (the reserve) is admitted exactly per request and the
// rest rejected (429 concurrency_limit_exceeded). The upstream never sees
// more than 40 of the key in flight, in any phase.
func TestLimitsSlicesParallelAcrossThresholdNeverOverAdmits(t *testing.T) {
	t.Parallel()
	const (
		capN   = 40
		phase  = 4 * time.Second
		stream = 300 * time.Millisecond
	)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "slthreshold")
	team := lfTeam(t, d, org, "team", nil)
	keyID, tok := lfKey(t, d, org, team, &adminv1.Limits{MaxParallelRequests: proto.Int64(capN)})
	var ps []*proxy
	for range 3 {
		ps = append(ps, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.NoLimitSlices = false }))
	}
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, ps, tok, "warm")
	leases := newSLLeases(t, d, org, keyID)
	cls := up.class("hot")

	// Samples: per phase, the most slots in use from slices across the
	// fleet and the most live exact leases of the key.
	type peaks struct{ slotsInUse, exact, sliceMembers int64 }
	var mu sync.Mutex
	got := make([]peaks, 3)
	var cur atomic.Int32
	var unavailable atomic.Int64
	sampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			select {
			case <-sampling:
				return
			case <-time.After(5 * time.Millisecond):
			}
			var inUse int64
			for _, p := range ps {
				inUse += p.DP.LimitSliceStats().SlotsInUse
			}
			sl, ex := leases.live(t)
			mu.Lock()
			pk := &got[cur.Load()]
			pk.slotsInUse, pk.exact, pk.sliceMembers = max(pk.slotsInUse, inUse), max(pk.exact, int64(ex)), max(pk.sliceMembers, int64(sl))
			mu.Unlock()
		}
	}()
	run := func(i, clients int) (admitted, rejected int) {
		cur.Store(int32(i))
		start := time.Now()
		ctx, stop := context.WithTimeout(context.Background(), phase)
		defer stop()
		wait := lfWorkers(ctx, clients, func(ctx context.Context, w int) {
			p := w % len(ps)
			r := c.do(context.Background(), ps[p].URL, p, tok, "hot", stream, true)
			if r.code == dataplane.CodeLimitsUnavailable {
				unavailable.Add(1) // a limits call over its timeout on a loaded machine: fails closed
			} else if r.status != http.StatusOK && r.code != dataplane.CodeConcurrencyLimitExceeded {
				t.Errorf("phase %d: %d %s %v", i, r.status, r.code, r.err)
			}
			lfPause(ctx, r, 10*time.Millisecond, 50*time.Millisecond)
		})
		wait()
		for _, r := range c.results() {
			if r.class != "hot" || r.start.Before(start) {
				continue
			}
			switch r.status {
			case http.StatusOK:
				admitted++
			case http.StatusTooManyRequests:
				rejected++
			}
		}
		return admitted, rejected
	}
	type result struct{ admitted, rejected int }
	t.Cleanup(func() { t.Logf("503 limits_unavailable (fail closed): %d", unavailable.Load()) })
	var res []result
	for i, n := range []int{9, 60, 9} {
		a, r := run(i, n)
		res = append(res, result{a, r})
	}
	close(sampling)
	<-sampled
	for i, r := range res {
		t.Logf("phase %d: %d admitted, %d rejected; peak slots in use from slices %d, slice members live %d, exact leases live %d",
			i+1, r.admitted, r.rejected, got[i].slotsInUse, got[i].sliceMembers, got[i].exact)
	}
	t.Logf("cap %d: upstream peak in flight %d over %d requests", capN, cls.peak.Load(), cls.total.Load())
	require.LessOrEqual(t, cls.peak.Load(), int64(capN), "the fleet admitted more than the cap in flight")
	// Slices before and after the pressure, exact admission and rejections
	// at the cap in between: the scope really crossed the threshold twice.
	require.Positive(t, got[0].slotsInUse, "phase 1 was not served from slices")
	require.Positive(t, got[1].exact, "phase 2 never admitted exactly (the reserve)")
	require.Positive(t, res[1].rejected, "phase 2 never reached the cap")
	require.Positive(t, got[2].slotsInUse, "phase 3 was not served from slices again")
	require.Zero(t, res[0].rejected, "phase 1 (9 clients, cap 40) was refused")
}

// TestLimitsSlicesParallelLoweredFleetWide is the limit-change must-show
// for concurrency slots: two sliced data planes hold slots of a key with
// max_parallel_requests 200 under load (30 clients of 300 ms streams);
// the limit is lowered to 5 through the admin API. One second after the
// update returned (plus one stream's length, for the streams admitted
// before), no more than 5 of the requests sent from then on are in flight at once, the upstream sees at most 5 of the key in flight from 2 s on (once the streams admitted before have ended, allowing for a loaded machine), and
// within 2 s neither data plane holds a slot of the key (5 is below
// MinParallel: the scope is revoked and admitted exactly).
func TestLimitsSlicesParallelLoweredFleetWide(t *testing.T) {
	t.Parallel()
	const (
		lowered = 5
		stream  = 300 * time.Millisecond
		clients = 30
	)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "sllowered")
	team := lfTeam(t, d, org, "team", nil)
	keyID, tok := lfKey(t, d, org, team, &adminv1.Limits{MaxParallelRequests: proto.Int64(200)})
	var ps []*proxy
	for range 2 {
		// A 1 s call timeout (as the other load-bound e2e tests): under the
		// lowered limit (5, below MinParallel) every request is admitted
		// exactly, and on a machine loaded 15 times over every call timed
		// out at 50 ms, so nothing was admitted after the change (503
		// limits_unavailable, failing closed as it must).
		ps = append(ps, d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
			c.NoLimitSlices, c.LimitsCallTimeout = false, time.Second
		}))
	}
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, ps, tok, "warm")
	cls := up.class("hot")

	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	wait := lfWorkers(ctx, clients, func(ctx context.Context, w int) {
		p := w % len(ps)
		r := c.do(context.Background(), ps[p].URL, p, tok, "hot", stream, true)
		if r.status != http.StatusOK && r.code != dataplane.CodeConcurrencyLimitExceeded && r.code != dataplane.CodeLimitsUnavailable {
			t.Errorf("%d %s %v", r.status, r.code, r.err)
		}
		lfPause(ctx, r, 10*time.Millisecond, 50*time.Millisecond)
	})
	ok := harness.Until(func() bool {
		return ps[0].DP.LimitSliceStats().SlotsInUse > 0 && ps[1].DP.LimitSliceStats().SlotsInUse > 0
	}, 15*time.Second, 10*time.Millisecond)
	require.True(t, ok, "the data planes never served the key from slot slices")
	time.Sleep(time.Second)
	before := cls.peak.Load()
	type catVer struct{ v, ev, reg uint64 }
	ver := func(p *proxy) catVer {
		c := p.DP.Catalog()
		return catVer{c.Version, c.EventsSeq, c.RegionSeq}
	}
	v0 := []catVer{ver(ps[0]), ver(ps[1])}
	_, err := d.Clients().Key.UpdateKey(context.Background(), connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: keyID, Limits: &adminv1.Limits{MaxParallelRequests: proto.Int64(lowered)}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
	require.NoError(t, err)
	updated := time.Now()
	// The bounds below are the slices' (revoked with the first request
	// after the change reaches a data plane), so they count from when the
	// change reached both data planes. On a machine loaded 15 times over
	// (the CI runs every package's tests at once) the change took from
	// 18 ms to more than 5 s to arrive (one run of four), and a data plane
	// that has not seen it yet admits under the old limit, as it must: the
	// test then failed on the upstream's peak (8 in flight 2 s after the
	// update) with the slot slices gone only 2.8–3.2 s after it. How fast
	// changes reach the data planes is not this test's subject (on a quiet
	// machine a few hundred ms: TestLimitsSlicesLimitLoweredFleetWide); it
	// waits for it up to 20 s and logs it.
	require.True(t, harness.Until(func() bool { return ver(ps[0]) != v0[0] && ver(ps[1]) != v0[1] }, 20*time.Second, time.Millisecond),
		"the change did not reach both data planes within 20 s")
	changed := time.Now()
	t.Logf("the change reached both data planes %s after UpdateKey returned", changed.Sub(updated).Round(time.Millisecond))

	// Sample the key's in flight at the upstream from the bound on.
	from := changed.Add(time.Second + stream + 50*time.Millisecond)
	var peakAfter, peakLate, samples int64
	var heldGone time.Duration
	for time.Since(changed) < 4*time.Second {
		if time.Now().After(from) {
			peakAfter = max(peakAfter, cls.inFlight.Load())
			samples++
		}
		if time.Since(changed) >= 2*time.Second {
			peakLate = max(peakLate, cls.inFlight.Load())
		}
		if heldGone == 0 && ps[0].DP.LimitSliceStats().HeldSlots == 0 && ps[1].DP.LimitSliceStats().HeldSlots == 0 {
			heldGone = time.Since(changed)
		}
		time.Sleep(2 * time.Millisecond)
	}
	admittedAfter := len(cls.arrivalsBetween(from, time.Now()))
	stop()
	wait()
	// The requests sent 1 s or more after the update (admitted under the
	// new limit): their streams in flight at once at the upstream (arrival
	// to the last chunk), a span within the one the proxy held each one's
	// slot over. (The client's view — response headers to the end of the
	// body — counts a stream until its client goroutine has read it, which
	// on a loaded machine may come after the proxy released the slot and
	// admitted the next request: it can see more at once than the proxy
	// ever held, a false failure.)
	bound := changed.Add(time.Second)
	var ivs [][2]time.Time
	for _, r := range c.results() {
		if r.class == "hot" && r.status == http.StatusOK && !r.start.Before(bound) {
			arrived, left, ok := cls.span(r.id)
			require.True(t, ok, "request %s answered 200 but its upstream span is unknown", r.id)
			ivs = append(ivs, [2]time.Time{arrived, left})
		}
	}
	var peakNew int64
	for _, a := range ivs {
		var n int64
		for _, b := range ivs {
			if !b[0].After(a[0]) && b[1].After(a[0]) {
				n++
			}
		}
		peakNew = max(peakNew, n)
	}
	t.Logf("max_parallel_requests 200 → %d: peak in flight before %d; from %s after the update: upstream peak %d over %d samples (from 2 s: %d), %d admitted; "+
		"requests sent ≥ 1 s after the update: %d admitted, at most %d at once; slot slices gone %s after the update",
		lowered, before, from.Sub(changed).Round(time.Millisecond), peakAfter, samples, peakLate, admittedAfter, len(ivs), peakNew, heldGone.Round(time.Millisecond))
	require.Greater(t, before, int64(lowered), "the key never had more than the new limit in flight before the change")
	require.LessOrEqual(t, peakNew, int64(lowered), "requests sent 1 s after the change admitted beyond the lowered limit")
	require.LessOrEqual(t, peakLate, int64(lowered), "more than the lowered limit in flight at the upstream 2 s after the change")
	require.Positive(t, admittedAfter, "nothing admitted after the change (the key should still get %d slots)", lowered)
	require.NotZero(t, heldGone, "slot slices still held 4 s after the limit fell below the threshold")
	require.Less(t, heldGone, 2*time.Second, "slot slices held too long after the change")
}

// TestLimitsSlicesProxySIGKILLSlotsExpireWithLease is "slices never
// outlive their lease" for a data plane that dies: a real `sluice proxy`
// process with --limit-slices and a 5 s lease TTL serves 12 streams of a
// key with max_parallel_requests 24 (sliced), so its slice members
// (~<instance>:<n>) are in the key's lease set, and is SIGKILLed. Every
// one of them (and every lease of its requests) expires in Redis within
// the lease TTL plus one renew interval of the kill and not before the TTL
// less one renew interval (they were held, and renewed, until the kill);
// then another data plane admits the whole cap at once.
func TestLimitsSlicesProxySIGKILLSlotsExpireWithLease(t *testing.T) {
	t.Parallel()
	const (
		capN     = 24
		streams  = 12
		leaseTTL = 5 * time.Second
		renew    = time.Second // limits.DefaultRenewInterval
		margin   = time.Second
	)
	bin := lfBuildSluice(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "slsigkill")
	team := lfTeam(t, d, org, "team", nil)
	keyID, tok := lfKey(t, d, org, team, &adminv1.Limits{MaxParallelRequests: proto.Int64(capN)})
	in := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.NoLimitSlices = false })
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, []*proxy{in}, tok, "poll")
	leases := newSLLeases(t, d, org, keyID)

	addr := "127.0.0.1:" + strconv.Itoa(lfFreePort(t))
	logs := &lfLogBuf{}
	cmd := exec.Command(bin, "proxy", "--addr", addr, "--region", "default", "--nats-url", d.NATS.URL,
		"--redis-url", d.RedisURL, "--redis-key-prefix", d.RedisPrefix, "--lease-ttl", leaseTTL.String(), "--limit-slices")
	cmd.Env = lfEnv("SLUICE_KEY_PEPPER="+testPepper, "SLUICE_KEK="+testKEK)
	cmd.Stdout, cmd.Stderr = logs, logs
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
	sub := "http://" + addr
	ok := harness.Until(func() bool {
		resp, err := http.Get(sub + "/readyz")
		if err != nil {
			return false
		}
		_ = resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond)
	require.True(t, ok, "sluice proxy never ready; its log:\n%s", logs)

	// Streams through the subprocess, restarted as they end, until it dies.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hold := up.class("hold")
	for range streams {
		go func() {
			for ctx.Err() == nil {
				r := c.do(ctx, sub, -1, tok, "hold", 1500*time.Millisecond, true)
				if r.err != nil && ctx.Err() == nil && r.status == 0 {
					return // the process died
				}
				lfPause(ctx, r, 20*time.Millisecond, 100*time.Millisecond)
			}
		}()
	}
	// The subprocess holds slot slices: the lease set has live members of
	// a data plane (the in-process one serves nothing meanwhile, and gives
	// back its own within Linger).
	ok = harness.Until(func() bool {
		sl, _ := leases.live(t)
		return hold.inFlight.Load() >= streams-2 && sl > 0 && in.DP.LimitSliceStats().HeldSlots == 0
	}, 20*time.Second, 20*time.Millisecond)
	sl, ex := leases.live(t)
	require.True(t, ok, "the subprocess never held slot slices (upstream in flight %d, slice members %d, in-process slots %d); its log:\n%s",
		hold.inFlight.Load(), sl, in.DP.LimitSliceStats().HeldSlots, logs)
	time.Sleep(2500 * time.Millisecond) // a few renewals by the subprocess
	// Kill it while it holds slice members (on a loaded machine a data
	// plane may give them back for a while and admit exactly).
	var slBefore, exBefore int
	ok = harness.Until(func() bool {
		slBefore, exBefore = leases.live(t)
		return slBefore > 0
	}, 15*time.Second, 5*time.Millisecond)
	require.True(t, ok, "the subprocess held no slice member after 2.5 s; its log:\n%s", logs)

	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	<-exited
	killed := time.Now()
	cancel()
	var gone time.Duration
	ok = harness.Until(func() bool {
		s, e := leases.live(t)
		if s+e == 0 {
			gone = time.Since(killed)
			return true
		}
		return false
	}, leaseTTL+renew+5*time.Second, 10*time.Millisecond)
	require.True(t, ok, "the dead proxy's leases and slice members never expired")
	lo, hi := leaseTTL-renew-margin/2, leaseTTL+renew+margin
	t.Logf("SIGKILLed sluice proxy with slices (lease TTL %s, renew every %s): %d slice members and %d request leases live when first seen (%d/%d at the kill); all expired %s after the kill; allowed window [%s, %s]",
		leaseTTL, renew, sl, ex, slBefore, exBefore, gone.Round(time.Millisecond), lo, hi)
	require.Positive(t, slBefore, "no slice member live at the kill")
	require.GreaterOrEqual(t, gone, lo, "slice members expired before the lease TTL: were they renewed?")
	require.LessOrEqual(t, gone, hi, "slice members outlived their lease")

	// The whole cap is available again, at once, through another data plane.
	ok = harness.Until(func() bool {
		res := make(chan int, capN)
		for range capN {
			go func() { res <- c.do(context.Background(), in.URL, 0, tok, "poll", 300*time.Millisecond, true).status }()
		}
		n := 0
		for range capN {
			if <-res == http.StatusOK {
				n++
			}
		}
		return n == capN
	}, 5*time.Second, 100*time.Millisecond)
	require.True(t, ok, "the whole cap did not come back after the dead proxy's leases expired")
}

// TestLimitsSlicesBlockWithinBound is "a block still within the existing
// bound" with quota slices: two sliced data planes serve a hot key (rpm
// and tpm far from their limits) from slices; the key is blocked through
// the admin API. No request sent 1 s or more after BlockKey returned (the
// revocation bound, TestRevocationLatencySmoke) is admitted, every answer
// after that is 403 key_blocked, and the slices of the key go back
// (blocks are checked before limits, so a blocked key's requests never
// reach its slices; the scope lingers out).
func TestLimitsSlicesBlockWithinBound(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "slblock")
	team := lfTeam(t, d, org, "team", nil)
	keyID, tok := lfKey(t, d, org, team, &adminv1.Limits{RpmLimit: proto.Int64(100_000), TpmLimit: proto.Int64(1e9)})
	var ps []*proxy
	for range 2 {
		ps = append(ps, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.NoLimitSlices = false }))
	}
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, ps, tok, "warm")
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	wait := lfWorkers(ctx, 8, func(ctx context.Context, w int) {
		p := w % len(ps)
		r := c.do(context.Background(), ps[p].URL, p, tok, "hot", 0, false)
		lfPause(ctx, r, 2*time.Millisecond, 10*time.Millisecond)
	})
	ok := harness.Until(func() bool {
		return ps[0].DP.LimitSliceStats().HeldRequests > 0 && ps[1].DP.LimitSliceStats().HeldRequests > 0
	}, 15*time.Second, 10*time.Millisecond)
	require.True(t, ok, "the data planes never held slices of the key")
	time.Sleep(time.Second)
	_, err := d.Clients().Key.BlockKey(context.Background(), connect.NewRequest(&adminv1.BlockKeyRequest{Id: keyID}))
	require.NoError(t, err)
	blocked := time.Now()
	time.Sleep(2500 * time.Millisecond)
	stop()
	wait()
	var lastOK time.Time
	var before, after, other int
	for _, r := range c.results() {
		if r.class != "hot" {
			continue
		}
		switch {
		case r.status == http.StatusOK && r.start.After(blocked):
			if r.start.After(lastOK) {
				lastOK = r.start
			}
		case r.status == http.StatusOK:
			before++
		case r.start.After(blocked.Add(time.Second)) && r.status == http.StatusForbidden && r.code == "key_blocked":
			after++
		case r.start.After(blocked.Add(time.Second)):
			other++
			t.Errorf("answer to a request sent %s after the block: %d %s %v", r.start.Sub(blocked), r.status, r.code, r.err)
		}
	}
	var lat time.Duration
	if !lastOK.IsZero() {
		lat = lastOK.Sub(blocked)
	}
	held := harness.Until(func() bool {
		return ps[0].DP.LimitSliceStats().HeldRequests == 0 && ps[1].DP.LimitSliceStats().HeldRequests == 0
	}, 3*time.Second, 20*time.Millisecond)
	t.Logf("blocked key served from slices: %d admitted before the block; the last admission sent %s after BlockKey returned (bound 1 s); %d key_blocked from 1 s on, %d other",
		before, lat.Round(time.Millisecond), after, other)
	require.Positive(t, before)
	require.Less(t, lat, time.Second, "a request of the blocked key was admitted 1 s or more after the block")
	require.Positive(t, after, "no key_blocked answer after the block")
	require.True(t, held, "the blocked key's rate slices were still held 2.5 s + 3 s after the block")
}
