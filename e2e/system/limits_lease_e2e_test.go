package system

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/internal/budget"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// lkStream is one stream a test holds open through a proxy: its request
// id and the content chunks its client received.
type lkStream struct {
	id     string
	mu     sync.Mutex
	chunks int64
	done   chan struct{}
}

func (s *lkStream) received() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.chunks
}

// lkOpenStream starts a chat stream of class "hold" (lfUpstream sends a
// chunk every lfChunkEvery for dur) with a large max_tokens, and counts the
// content chunks the client receives until the stream ends or breaks.
func lkOpenStream(t testing.TB, proxyURL, tok string, n int, dur time.Duration) *lkStream {
	t.Helper()
	body := fmt.Sprintf(`{"model":"lf","stream":true,"max_tokens":4000,"messages":[{"role":"user","content":"lf|hold|lk-%d|%d"}]}`,
		n, dur.Milliseconds())
	req, err := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "stream %d refused", n)
	s := &lkStream{id: resp.Header.Get(dataplane.RequestIDHeader), done: make(chan struct{})}
	require.NotEmpty(t, s.id)
	go func() {
		defer close(s.done)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if strings.Contains(sc.Text(), `"content":"t`) {
				s.mu.Lock()
				s.chunks++
				s.mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { _ = resp.Body.Close(); <-s.done })
	return s
}

// TestLimitsProxySIGKILLSettlesStreams (issue 19): a real `sluice proxy`
// process relays 5 streams of a budgeted key and is SIGKILLed (twice: 5
// chunks into the streams, and 50 chunks in). The sweeper
// of another data plane settles them once their leases expire: within the
// lease TTL plus one sweep interval of the kill their reservations are
// gone from Redis (records swept, lease index empty, leases released, the
// key's budget holding exactly the spend the ledger records), and their
// usage events land in the ledger (Postgres spend_logs) with error code
// proxy_lost and at least the completion tokens their clients received.
func TestLimitsProxySIGKILLSettlesStreams(t *testing.T) {
	t.Parallel()
	const (
		streams  = 5
		leaseTTL = 5 * time.Second
		sweep    = leaseTTL / 4 // limits.Limiter.SweepInterval
		margin   = 2 * time.Second
	)
	bin := lfBuildSluice(t)
	d := startDist(t)
	up := lfStartUpstream(t)
	lfModel(t, d, up, lfPrices)
	org := lfOrg(t, d, "lease")
	team := lfTeam(t, d, org, "team", nil)
	keyID, tok := lfKey(t, d, org, team, &adminv1.Limits{MaxBudget: proto.Float64(100), BudgetDuration: "1d",
		MaxParallelRequests: proto.Int64(20), TpmLimit: proto.Int64(10_000_000)})
	// The sweeping data plane (in process) runs with the same lease TTL,
	// hence the same sweep interval. Exact mode too: a sliced data plane
	// carves and returns budget slices of this key, which would move the
	// budget counter this test reads.
	in := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.LeaseTTL, c.NoLimitSlices = leaseTTL, true })
	c := lfNewClient(t)
	lfWaitAdmitted(t, c, []*proxy{in}, tok, "poll")

	kill := func(phase int, name string, minChunks int64) {
		addr := "127.0.0.1:" + strconv.Itoa(lfFreePort(t))
		logs := &lfLogBuf{}
		cmd := exec.Command(bin, "proxy", "--addr", addr, "--region", "default", "--nats-url", d.NATS.URL,
			"--redis-url", d.RedisURL, "--redis-key-prefix", d.RedisPrefix, "--lease-ttl", leaseTTL.String(),
			// Exact mode: this test asserts exact admission's per-request
			// records and reservations (each stream's record written at
			// admission, its reservation back to the micro-dollar). A sliced
			// request writes its record half a renew interval after it is
			// born and reserves from its proxy's budget slice, whose
			// watermark stays charged when the proxy dies (docs/limits.md,
			// "Quota slices").
			"--limit-slices=false")
		cmd.Env = lfEnv("SLUICE_KEY_PEPPER="+testPepper, "SLUICE_KEK="+testKEK)
		cmd.Stdout, cmd.Stderr = logs, logs
		require.NoError(t, cmd.Start())
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-exited })
		sub := "http://" + addr
		lfWaitAdmitted(t, c, []*proxy{{URL: sub}}, tok, "poll")

		rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
		t.Cleanup(func() { _ = rdb.Close() })
		ctx := context.Background()
		tag := d.RedisPrefix + "{o:" + org + "}:"
		spend := func() int64 {
			v, err := rdb.HGet(ctx, tag+"lim:key:"+keyID, "bs").Int64()
			require.NoError(t, err)
			return v
		}
		// The counter before the streams, once settled: the poll that
		// found the subprocess ready was settled asynchronously (its
		// reservation replaced by its real cost), and a settlement landing
		// after this read would take up to its reservation off the streams'
		// (5 reservations exceed 20M µ$ by only their prompts' estimates).
		var before int64
		last, since := spend(), time.Now()
		require.True(t, harness.Until(func() bool {
			if v := spend(); v != last {
				last, since = v, time.Now()
			}
			before = last
			return time.Since(since) >= 300*time.Millisecond
		}, 10*time.Second, 20*time.Millisecond), "the budget counter never settled")

		var ss []*lkStream
		for i := range streams {
			ss = append(ss, lkOpenStream(t, sub, tok, phase*streams+i, time.Minute))
		}
		hold := up.class("hold")
		require.True(t, harness.Until(func() bool { return hold.inFlight.Load() == streams }, 20*time.Second, 50*time.Millisecond),
			"the subprocess never held %d streams; its log:\n%s", streams, logs)
		require.True(t, harness.Until(func() bool {
			for _, s := range ss {
				if s.received() < minChunks {
					return false
				}
			}
			return true
		}, 30*time.Second, 50*time.Millisecond),

			"the streams never reached %d chunks", minChunks)
		reserved := spend() - before
		require.Greater(t, reserved, int64(streams*4000*1000), "the budget holds 5 reservations of 4000 output tokens at $1e-3")

		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		<-exited
		killed := time.Now()
		relayed := map[string]int64{}
		for _, s := range ss {
			<-s.done // the connection broke with the process
			relayed[s.id] = s.received()
		}

		// The reservations leave Redis within the lease TTL plus one sweep.
		var gone time.Time
		require.True(t, harness.Until(func() bool {
			for _, s := range ss {
				if v, _ := rdb.Get(ctx, tag+"req:"+s.id).Result(); v != "swept" {
					return false
				}
			}
			gone = time.Now()
			return true
		}, leaseTTL+sweep+margin+10*time.Second, 50*time.Millisecond),

			"the lost streams were never swept")
		took := gone.Sub(killed)
		n, err := rdb.Exists(ctx, tag+"leases").Result()
		require.NoError(t, err)
		require.Zero(t, n, "the lease index is empty")
		n, err = rdb.ZCard(ctx, tag+"par:key:"+keyID).Result()
		require.NoError(t, err)
		require.Zero(t, n, "the leases are released")

		// The ledger receives the 5 usage events.
		var rows map[string]*spendRow
		require.True(t, harness.Until(func() bool {
			rows = d.spendRows(t)
			for _, s := range ss {
				if rows[s.id] == nil {
					return false
				}
			}
			return true
		}, 30*time.Second, 50*time.Millisecond),

			"the lost streams' usage events never reached the ledger")
		var sweptMicros int64
		for _, s := range ss {
			r := rows[s.id]
			t.Logf("stream %s: %d chunks received, ledger %d prompt + %d completion tokens, $%.6f, status %d %s",
				s.id, relayed[s.id], r.prompt, r.completion, r.cost, r.status, r.code)
			require.Equal(t, dataplane.CodeProxyLost, r.code)
			require.EqualValues(t, http.StatusOK, r.status, "the client had its 200")
			require.GreaterOrEqual(t, r.completion, relayed[s.id], "the ledger records at least what the client received")
			require.Less(t, r.completion, int64(4000), "the report is a bound, not the reservation")
			require.Equal(t, keyID, r.key)
			require.Equal(t, team, r.team)
			require.Equal(t, org, r.org)
			require.True(t, r.stream)
			require.NotEmpty(t, r.dep)
			sweptMicros += budget.Micros(r.cost)
		}
		// What remains in the budget is what the ledger records: the rest of
		// the reservations went back.
		require.InDelta(t, before+sweptMicros, spend(), streams, "budget = spend before + the swept streams' ledger cost")
		t.Logf("%s: %d streams of a SIGKILLed proxy (lease TTL %s, sweep every %s): reservations of $%s gone %s after the kill (bound %s); $%s charged",
			name, streams, leaseTTL, sweep, strconv.FormatFloat(float64(reserved)/1e6, 'f', 3, 64), took.Round(time.Millisecond),
			leaseTTL+sweep+margin, strconv.FormatFloat(float64(sweptMicros)/1e6, 'f', 6, 64))
		require.LessOrEqual(t, took, leaseTTL+sweep*11/10+margin, "the reservations outlived the lease TTL plus one sweep")
	}
	// Killed before the streams' first periodic renewal (the report of the
	// renewal their upstream's answer kicked covers them), then after
	// several renewals (each with its report).
	kill(0, "before the first periodic renewal", 5)
	kill(1, "after several renewals", 50)
}
