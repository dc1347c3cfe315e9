package system

import (
	"bufio"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/internal/gctune"
	"github.com/sluicegw/sluice/internal/rawhttp"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// The limits overhead (issue 5, "Overhead benchmark"): one data plane, two
// keys, one zero-latency upstream, a dedicated redis-server. The "off" key
// (its own org, no limit at any level) must cause no Redis call at all;
// the "on" key carries rpm, tpm, max_parallel_requests and a budget at key,
// team and org level and must cost exactly one Redis round trip (one
// EVALSHA of admit.lua) before the upstream sees the request, and one
// settle (EVALSHA of settle.lua) after it.
//
// How the round trips are counted (llRig.audit): requests are sent one at a
// time; Redis's own counter of EVALSHA calls (INFO commandstats, read on a
// connection of the test's own) is read by the upstream the moment a
// request reaches it, so "admission is the only call before the upstream
// sees it" is checked against Redis's state at that instant; a MONITOR
// connection records every top-level command (commands run by the
// scripts themselves show as "lua" and are not round trips), so every
// command the proxy sent is attributed to a request id and a script by
// its SHA. TestLimitsOneRoundTrip runs the audit in the normal test run;
// BenchmarkLimitsOverhead runs it on more requests, then, once the limited
// key's rate windows are full (llTrickle), measures throughput at c=64 and
// p50 at c=1 with limits off and on, interleaved, and reports the on/off
// throughput ratio (target ≥ 0.8) and the added p50:
//
//	make bench-limits
//	SLUICE_BENCH_ROUNDS=5 go test -run '^$' -bench BenchmarkLimitsOverhead -benchtime 1x -v ./dataplane/
//
// As in BenchmarkProxyOverhead, NATS and the control plane run as their
// own processes (nice 19), the data plane, the load client and the
// upstream in the benchmark process; redis-server is its own process at
// normal priority (it is on the request path).

const (
	// llBenchConcurrency is the load's concurrency, as in
	// BenchmarkProxyOverhead: enough that the data plane's core stays
	// saturated although every limited request waits on a Redis round
	// trip (at ~6k req/s and ~1 ms per admission, several requests are
	// always waiting on Redis).
	llBenchConcurrency = 64
	llBenchSeq         = 2000            // requests per key at c=1
	llBenchLoad        = 3 * time.Second // per key at c=64
	llBenchAudit       = 500             // requests per key in the benchmark's round-trip audit
)

// llRedis is a dedicated redis-server in a temporary directory.
type llRedis struct {
	addr string
	url  string
	cmd  *exec.Cmd
}

// llStartRedis starts redis-server on a free loopback port without
// persistence; it is killed at cleanup. A missing binary fails the test.
func llStartRedis(tb testing.TB) *llRedis {
	tb.Helper()
	dir := tb.TempDir()
	port := freePort(tb)
	args := []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "",
		"--appendonly", "no", "--dir", dir, "--logfile", filepath.Join(dir, "redis.log")}
	cmd := exec.Command("redis-server", args...)
	if cpu := os.Getenv("SLUICE_BENCH_REDIS_CPU"); cpu != "" {
		// Redis on a core of its own, standing in for another machine
		// (make bench-limits-split runs the benchmark process on the other).
		cmd = exec.Command("taskset", append([]string{"-c", cpu, "redis-server"}, args...)...)
	}
	require.NoError(tb, cmd.Start(), "redis-server must be on PATH")
	tb.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	r := &llRedis{addr: fmt.Sprintf("127.0.0.1:%d", port), cmd: cmd}
	r.url = "redis://" + r.addr + "/0"
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := llDialRESP(r.addr)
		if err == nil {
			_, err = c.do("PING")
			c.close()
			if err == nil {
				return r
			}
		}
		if time.Now().After(deadline) {
			tb.Fatalf("redis-server on %s did not start: %v", r.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// llRESP is one plain RESP connection (the test's own, so its commands
// are told apart from the proxy's in MONITOR by its address).
type llRESP struct {
	mu sync.Mutex
	c  net.Conn
	r  *bufio.Reader
}

func llDialRESP(addr string) (*llRESP, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return nil, err
	}
	return &llRESP{c: c, r: bufio.NewReader(c)}, nil
}

func (c *llRESP) close()            { _ = c.c.Close() }
func (c *llRESP) localAddr() string { return c.c.LocalAddr().String() }

// do sends one command and returns its reply (simple, integer or bulk
// string; an error reply is an error).
func (c *llRESP) do(args ...string) (string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	_ = c.c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c.c, b.String()); err != nil {
		return "", err
	}
	line, err := c.r.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return "", errors.New(line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil || n < 0 {
			return "", err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(c.r, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	return "", fmt.Errorf("unexpected reply %q", line)
}

// evalshaStats returns Redis's count of EVALSHA calls and their total
// execution time in µs (INFO commandstats).
func (c *llRESP) evalshaStats(tb testing.TB) (calls, usec int64) {
	info, err := c.do("INFO", "commandstats")
	require.NoError(tb, err)
	return llCmdCalls(info, "evalsha"), llCmdStat(info, "evalsha", "usec")
}

// redisCPU returns redis-server's CPU time (INFO cpu: used_cpu_sys +
// used_cpu_user, to the microsecond; /proc counts in 10 ms ticks, too
// coarse for turns of 150 ms).
func (c *llRESP) redisCPU(tb testing.TB) time.Duration {
	info, err := c.do("INFO", "cpu")
	require.NoError(tb, err)
	var total float64
	for line := range strings.SplitSeq(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, err := strconv.ParseFloat(v, 64)
			require.NoError(tb, err, "INFO cpu %s", line)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// evalshaCalls returns Redis's count of EVALSHA calls (INFO commandstats).
func (c *llRESP) evalshaCalls(tb testing.TB) int64 {
	info, err := c.do("INFO", "commandstats")
	require.NoError(tb, err)
	return llCmdCalls(info, "evalsha")
}

// llCmdCalls extracts cmdstat_<cmd>:calls=N from INFO commandstats.
func llCmdCalls(info, cmd string) int64 { return llCmdStat(info, cmd, "calls") }

// llCmdStat extracts field of cmdstat_<cmd> from INFO commandstats.
func llCmdStat(info, cmd, field string) int64 {
	for line := range strings.SplitSeq(info, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+cmd+":")
		if !ok {
			continue
		}
		for kv := range strings.SplitSeq(rest, ",") {
			if v, ok := strings.CutPrefix(kv, field+"="); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				return n
			}
		}
	}
	return 0
}

// llMetric returns the value of a series on p's /metrics (0 if absent).
func llMetric(tb testing.TB, p *proxy, series string) int64 {
	tb.Helper()
	resp, err := http.Get(p.URL + "/metrics")
	require.NoError(tb, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(tb, err)
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			require.NoError(tb, err)
			return int64(f)
		}
	}
	return 0
}

// llMonLine is one command MONITOR reported.
type llMonLine struct {
	at   time.Time
	src  string // client address, or "lua" for commands run by a script
	args []string
}

// llMonitor records every command a redis-server runs.
type llMonitor struct {
	c     net.Conn
	mu    sync.Mutex
	lines []llMonLine
	done  chan struct{}
}

func llStartMonitor(tb testing.TB, addr string) *llMonitor {
	tb.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	require.NoError(tb, err)
	_, err = io.WriteString(c, "*1\r\n$7\r\nMONITOR\r\n")
	require.NoError(tb, err)
	r := bufio.NewReaderSize(c, 1<<16)
	ok, err := r.ReadString('\n')
	require.NoError(tb, err)
	require.Equal(tb, "+OK\r\n", ok)
	m := &llMonitor{c: c, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				return
			}
			if l, ok := llParseMonitor(strings.TrimRight(line, "\r\n")); ok {
				m.mu.Lock()
				m.lines = append(m.lines, l)
				m.mu.Unlock()
			}
		}
	}()
	tb.Cleanup(m.stop)
	return m
}

func (m *llMonitor) stop() { _ = m.c.Close(); <-m.done }

// sync makes sure every command Redis ran before now has been read: it
// sends an ECHO of a fresh marker on rc and waits for it. It returns the
// lines recorded so far.
func (m *llMonitor) sync(tb testing.TB, rc *llRESP) []llMonLine {
	tb.Helper()
	marker := fmt.Sprintf("llsync-%d", time.Now().UnixNano())
	_, err := rc.do("ECHO", marker)
	require.NoError(tb, err)
	deadline := time.Now().Add(10 * time.Second)
	for {
		m.mu.Lock()
		n := len(m.lines)
		found := false
		for i := n - 1; i >= 0 && i >= n-50; i-- {
			if a := m.lines[i].args; len(a) == 2 && strings.EqualFold(a[0], "echo") && a[1] == marker {
				found = true
				break
			}
		}
		out := slices.Clone(m.lines)
		m.mu.Unlock()
		if found {
			return out
		}
		if time.Now().After(deadline) {
			tb.Fatalf("MONITOR never showed marker %s", marker)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// llParseMonitor parses `+1700000000.123456 [0 127.0.0.1:5555] "cmd" "arg"`.
func llParseMonitor(line string) (llMonLine, bool) {
	line = strings.TrimPrefix(line, "+")
	ts, rest, ok := strings.Cut(line, " [")
	if !ok {
		return llMonLine{}, false
	}
	src, rest, ok := strings.Cut(rest, "] ")
	if !ok {
		return llMonLine{}, false
	}
	_, src, _ = strings.Cut(src, " ") // drop the db number
	sec, frac, _ := strings.Cut(ts, ".")
	s, err1 := strconv.ParseInt(sec, 10, 64)
	us, err2 := strconv.ParseInt(frac, 10, 64)
	if err1 != nil || err2 != nil {
		return llMonLine{}, false
	}
	l := llMonLine{at: time.Unix(s, us*1000), src: src}
	for rest != "" {
		rest = strings.TrimLeft(rest, " ")
		if rest == "" || rest[0] != '"' {
			break
		}
		var b strings.Builder
		i := 1
		for ; i < len(rest) && rest[i] != '"'; i++ {
			ch := rest[i]
			if ch != '\\' || i+1 >= len(rest) {
				b.WriteByte(ch)
				continue
			}
			i++
			switch rest[i] {
			case 'n':
				b.WriteByte('\n')
			case 'r':
				b.WriteByte('\r')
			case 't':
				b.WriteByte('\t')
			case 'a':
				b.WriteByte('\a')
			case 'b':
				b.WriteByte('\b')
			case 'x':
				if i+2 < len(rest) {
					v, _ := strconv.ParseUint(rest[i+1:i+3], 16, 8)
					b.WriteByte(byte(v))
					i += 2
				}
			default:
				b.WriteByte(rest[i])
			}
		}
		l.args = append(l.args, b.String())
		rest = rest[min(i+1, len(rest)):]
	}
	return l, len(l.args) > 0
}

// llLuaDir holds the limits scripts, relative to this package (tests run
// in ./e2e/system).
const llLuaDir = "../../dataplane/internal/limits/lua/"

// llScriptSHA is the SHA go-redis sends with EVALSHA for a script of
// dataplane/internal/limits (common.lua prepended, see scripts.go).
func llScriptSHA(tb testing.TB, name string) string {
	tb.Helper()
	common, err := os.ReadFile(llLuaDir + "common.lua")
	require.NoError(tb, err)
	body, err := os.ReadFile(llLuaDir + name + ".lua")
	require.NoError(tb, err)
	sum := sha1.Sum([]byte(string(common) + "\n" + string(body)))
	return hex.EncodeToString(sum[:])
}

// llRig is one data plane on a dedicated Redis with a key without limits
// and a key limited at every level.
type llRig struct {
	d       *dist
	p       *proxy
	redis   *llRedis
	up      *httptest.Server
	off, on tenant
	// ps is a second data plane with quota slices on (the default),
	// and rate a tenant limited at key, team and org by rpm and tpm only
	// (addSliced; nil and zero until then).
	ps *proxy
	// pb is the sliced data plane again, as a process of its own: the
	// `sluice proxy` binary (its heap floor and GC its own, not shared
	// with the load client); pbPid its process.
	pb        *proxy
	pbPid     int
	rate      tenant
	onArrival atomic.Pointer[func(*http.Request)]
	// trickled counts the benchmark's background requests (llTrickle)
	// answered 200; trickleUnavailable those answered 503
	// limits_unavailable (an admission that timed out, then cancelled:
	// two EVALSHA calls too, which the phases' accounting subtracts as
	// the trickle's).
	trickled, trickleUnavailable atomic.Int64
	profiled                     bool // SLUICE_BENCH_CPUPROFILE was written
	// redisIdle is redis-server's CPU per second of wall time with only
	// the background running (the trickle, the data planes' idle calls),
	// measured before the rounds: subtracted from each phase's Redis CPU
	// for the figure "net of the background".
	redisIdle float64
	// machineIdle is the same for the whole machine (every process: the
	// trickle through the data plane, the ledger, NATS, Postgres, the
	// control plane). It is spread over a phase's requests too, so a
	// phase with less throughput pays more of it per request.
	machineIdle float64
	// infra samples the CPU of NATS, the control plane and Postgres
	// (startBenchInfra; nil outside BenchmarkLimitsOverhead).
	infra func() infraCPU
}

// machineBusy is the CPU time all of the machine's cores spent outside
// idle and iowait, and outside steal: the time the hypervisor gave to
// other guests while this machine's processes were ready to run (a
// virtual machine's cores are shared; see machineStat).
func machineBusy() time.Duration {
	busy, _ := machineStat()
	return busy
}

// machineStat returns the busy time (machineBusy) and the steal time of
// /proc/stat's cpu line: the time the machine's cores were ready to run
// but the hypervisor ran another guest. A phase with much steal answers
// fewer requests for reasons that are not its own: measureGroup reports it
// per key, so that a round's ratio can be read against it.
func machineStat() (busy, steal time.Duration) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal guest guest_nice
	var ticks, stolen int64
	for i, x := range f[1:] {
		v, _ := strconv.ParseInt(x, 10, 64)
		switch {
		case i == 7:
			stolen = v
		case i == 3 || i == 4 || i >= 8: // idle, iowait; guest time is in user already
		default:
			ticks += v
		}
	}
	return time.Duration(ticks) * 10 * time.Millisecond, time.Duration(stolen) * 10 * time.Millisecond
}

// measureRedisIdle measures redis-server's and the whole machine's CPU
// per second of wall time over d with only the background load running.
func (r *llRig) measureRedisIdle(tb testing.TB, rc *llRESP, d time.Duration) {
	c0, m0, t0 := rc.redisCPU(tb), machineBusy(), time.Now()
	time.Sleep(d)
	el := time.Since(t0).Seconds()
	r.redisIdle = float64(rc.redisCPU(tb)-c0) / el
	r.machineIdle = float64(machineBusy()-m0) / el
}

// llOnLimits are the limits of the "on" key's levels: never reached by the benchmark, so
// every request is admitted and settled; each level carries every kind.
func llOnLimits() *adminv1.Limits {
	return &adminv1.Limits{RpmLimit: proto.Int64(1e10), TpmLimit: proto.Int64(1e12), MaxParallelRequests: proto.Int64(1e5),
		MaxBudget: proto.Float64(1e6), BudgetDuration: "1d"}
}

// llSetupRig builds the rig on d: upstream, deployment, the two tenants,
// a data plane on a dedicated redis-server, and warmed-up keys.
func llSetupRig(tb testing.TB, d *dist) *llRig {
	tb.Helper()
	ctx := context.Background()
	r := &llRig{d: d, redis: llStartRedis(tb)}
	base := benchUpstream(0)
	r.up = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if f := r.onArrival.Load(); f != nil {
			(*f)(req)
		}
		base.ServeHTTP(w, req)
	}))
	tb.Cleanup(r.up.Close)

	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "bench", PlatformWide: true}))
	require.NoError(tb, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "bench",
		ApiBase: r.up.URL + "/v1", UpstreamModel: "bench-upstream", Weight: 1,
		Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}}))
	require.NoError(tb, err)
	r.off, r.on = d.NewTenant("limits-off"), d.NewTenant("limits-on")
	c := d.Clients()
	mask := &fieldmaskpb.FieldMask{Paths: []string{"limits"}}
	_, err = c.Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{Org: &adminv1.Org{Id: r.on.OrgID, Limits: llOnLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)
	_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: r.on.TeamID, Limits: llOnLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)
	_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: r.on.KeyID, Limits: llOnLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)

	// r.p admits exactly (--limit-slices=false): the benchmark's exact
	// phases and the one-round-trip audit measure exact admission.
	r.p = d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
		c.RedisURL, c.RedisKeyPrefix, c.NoLimitSlices = r.redis.url, "llb:", true
	})
	d.waitCaughtUp(tb, 15*time.Second, r.p)
	// The orgs' limits state is new to this Redis: the first requests of
	// the "on" org wait out the epoch quarantine (docs/limits.md); the
	// first script calls also load the scripts (EVALSHA, then EVAL).
	cl := benchClient()
	for _, tok := range []string{r.off.Token, r.on.Token} {
		deadline := time.Now().Add(15 * time.Second)
		for {
			_, st, err := llChat(cl, r.p.URL, tok)
			if st == http.StatusOK {
				break
			}
			require.True(tb, time.Now().Before(deadline), "key never admitted: %v", err)
			time.Sleep(20 * time.Millisecond)
		}
		for range 20 {
			_, st, err := llChat(cl, r.p.URL, tok)
			require.NoError(tb, err)
			require.Equal(tb, http.StatusOK, st)
		}
	}
	return r
}

// llRateLimits are the rate-only tenant's limits: rpm and tpm, never
// reached, at each level.
func llRateLimits() *adminv1.Limits {
	return &adminv1.Limits{RpmLimit: proto.Int64(1e10), TpmLimit: proto.Int64(1e12)}
}

// addSliced starts the rig's second data plane, with quota slices on, on
// the same Redis and key prefix (the same fleet), and the rate-only
// tenant, warmed up through it.
func (r *llRig) addSliced(tb testing.TB) {
	tb.Helper()
	ctx := context.Background()
	d := r.d
	r.rate = d.NewTenant("limits-rate")
	c := d.Clients()
	mask := &fieldmaskpb.FieldMask{Paths: []string{"limits"}}
	_, err := c.Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{Org: &adminv1.Org{Id: r.rate.OrgID, Limits: llRateLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)
	_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{Team: &adminv1.Team{Id: r.rate.TeamID, Limits: llRateLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)
	_, err = c.Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{Key: &adminv1.Key{Id: r.rate.KeyID, Limits: llRateLimits()}, UpdateMask: mask}))
	require.NoError(tb, err)
	r.ps = d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
		c.RedisURL, c.RedisKeyPrefix = r.redis.url, "llb:" // quota slices: the default
	})
	d.waitCaughtUp(tb, 15*time.Second, r.ps, r.p)
	cl := benchClient()
	for _, tok := range []string{r.rate.Token, r.on.Token} {
		require.Eventually(tb, func() bool {
			_, st, _ := llChat(cl, r.ps.URL, tok)
			return st == http.StatusOK
		}, 15*time.Second, 20*time.Millisecond, "key never admitted")
		unavailable := 0
		for range 20 {
			_, st, err := llChat(cl, r.ps.URL, tok)
			if err != nil && strings.Contains(err.Error(), `"`+dataplane.CodeLimitsUnavailable+`"`) && unavailable < 3 {
				unavailable++ // an exact admission over its 50 ms timeout on a loaded machine
				tb.Logf("warm-up through the sliced data plane: %v", err)
				continue
			}
			require.NoError(tb, err)
			require.Equal(tb, http.StatusOK, st)
		}
	}
	// The slice worker has carved (and loaded carve.lua into Redis).
	require.Eventually(tb, func() bool { return r.ps.DP.LimitSliceStats().CarveCalls > 0 }, 5*time.Second, 10*time.Millisecond)
}

// addSlicedBinary starts the sliced data plane a second time, as the
// `sluice proxy` binary (startBenchInfra built it) on the same NATS, Redis
// and key prefix, with its flags at their defaults, and warms it up with
// the limited keys.
func (r *llRig) addSlicedBinary(tb testing.TB) {
	tb.Helper()
	require.NotEmpty(tb, benchSluiceBin, "startBenchInfra builds the sluice binary")
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(tb))
	cmd := exec.Command(benchSluiceBin, "proxy", "--addr", addr, "--nats-url", r.d.NATS.URL, "--redis-url", r.redis.url,
		"--redis-key-prefix", "llb:", "--instance-id", "bench-dp-binary", "--log-level", "warn")
	if a := os.Getenv("SLUICE_BENCH_PROXY_PPROF"); a != "" {
		// To profile the binary during the benchmark, split by key
		// (go tool pprof -tagfocus key=<id>).
		cmd.Args = append(cmd.Args, "--pprof-addr", a, "--pprof-labels")
		tb.Logf("the binary data plane serves its profiler on %s, labelled by key: off %s, every kind %s, rpm/tpm only %s",
			a, r.off.KeyID, r.on.KeyID, r.rate.KeyID)
	}
	cmd.Env = append(os.Environ(), "SLUICE_KEY_PEPPER="+testPepper, "SLUICE_KEK="+testKEK)
	startProc(tb, cmd)
	r.pb, r.pbPid = &proxy{URL: "http://" + addr, Cancel: func() {}}, cmd.Process.Pid
	harness.Eventually(tb, func() bool {
		resp, err := http.Get(r.pb.URL + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "sluice proxy (binary) not ready")
	cl := benchClient()
	for _, tok := range []string{r.off.Token, r.rate.Token, r.on.Token} {
		require.Eventually(tb, func() bool {
			_, st, _ := llChat(cl, r.pb.URL, tok)
			return st == http.StatusOK
		}, 15*time.Second, 20*time.Millisecond, "key never admitted by the binary")
	}
}

// llChat sends the benchmark's chat request and returns the request id
// and status.
func llChat(c *http.Client, base, tok string) (string, int, error) {
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/chat/completions", strings.NewReader(benchChatBody))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := c.Do(req)
	if err != nil {
		return "", 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return resp.Header.Get(dataplane.RequestIDHeader), resp.StatusCode, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	return resp.Header.Get(dataplane.RequestIDHeader), resp.StatusCode, nil
}

// llAuditResult is what the round-trip audit saw.
type llAuditResult struct {
	on, off int
	// onBefore[k] (offBefore[k]) counts limited (unlimited) requests that
	// reached the upstream after k EVALSHA calls of their own.
	onBefore, offBefore map[int64]int
	// connSetup counts connection handshakes (HELLO, CLIENT SETINFO, ...)
	// of the proxy's Redis pool seen during the audit: not per request.
	connSetup map[string]int
	// sweepScans counts the lease sweeper's scans of lease indexes (ZRANGE
	// of <org>:leases and of the budget-lease index <org>:bhx, every
	// quarter lease TTL): not per request.
	sweepScans int
	// admitToUpstream is the largest delay between a request's admission
	// (Redis time) and its arrival at the upstream.
	admitToUpstream time.Duration
	// local counts limited requests that made no Redis call at all
	// (admitted from quota slices, auditSliced); sliceCalls the slice
	// worker's carve.lua calls during the audit (not per request).
	local, sliceCalls int
	// pings counts the slice worker's heartbeats (PING, every tick it has
	// nothing else to send while it holds slices): not per request.
	pings int
	// skipped limited requests were answered 503 limits_unavailable;
	// settleRetries and renewals are extra calls after the upstream saw a
	// request (both reported; zero on an idle machine).
	skipped, settleRetries, renewals int
}

// llConnSetupCommands are what go-redis sends when it opens a connection.
var llConnSetupCommands = map[string]bool{"hello": true, "client": true, "auth": true, "select": true, "ping": true}

// audit sends n requests on each key, alternating, one at a time, and
// asserts: a request of the "off" key causes no Redis command; a request
// of the "on" key exactly one EVALSHA of admit.lua before the upstream
// sees it (Redis's EVALSHA count read by the upstream at arrival, and the
// MONITOR timestamps) and one EVALSHA of settle.lua after it (a settlement
// that timed out is retried, idempotently; a request older than the renew
// interval also renews: both are counted and reported), and the proxy
// sends nothing else. A request answered 503 limits_unavailable (a call
// over its 50 ms timeout on a loaded machine) is left out and counted.
func (r *llRig) audit(tb testing.TB, n int) llAuditResult {
	return r.auditOn(tb, n, r.p, r.on.Token, false)
}

// auditSliced is the audit through the data plane with quota slices on,
// with the limited key tok (the rate-only key, or the "on" key limited by
// every kind): a limited request that fits its slices makes no Redis call
// at all (none carries its request id, in MONITOR); at least 90 % of them
// fit (a request that arrives while one of its scopes' slices is being
// refilled is admitted exactly: one admission before the upstream and one
// settlement after, as in the audit). The slice worker's carve.lua calls
// are counted apart; nothing else is sent.
func (r *llRig) auditSliced(tb testing.TB, n int, tok string) llAuditResult {
	res := r.auditOn(tb, n, r.ps, tok, true)
	require.GreaterOrEqual(tb, res.local, res.on*9/10, "limited requests admitted from slices, without a Redis call")
	return res
}

// auditOn runs the audit through p with onTok as the limited key; sliced
// selects auditSliced's rules.
func (r *llRig) auditOn(tb testing.TB, n int, p *proxy, onTok string, sliced bool) llAuditResult {
	tb.Helper()
	rc, err := llDialRESP(r.redis.addr)
	require.NoError(tb, err)
	defer rc.close()
	admitSHA, settleSHA, renewSHA := llScriptSHA(tb, "admit"), llScriptSHA(tb, "settle"), llScriptSHA(tb, "renew")
	carveSHA := llScriptSHA(tb, "carve")
	mon := llStartMonitor(tb, r.redis.addr)
	defer mon.stop()
	start := len(mon.sync(tb, rc))

	type seen struct {
		at    time.Time
		calls int64 // EVALSHA calls since the request was sent, at upstream arrival
		err   error
	}
	var mu sync.Mutex
	arrivals := map[string]seen{}
	var base atomic.Int64
	check := func(req *http.Request) { // on the upstream's goroutine: no require here
		at := time.Now()
		info, err := rc.do("INFO", "commandstats")
		mu.Lock()
		arrivals[req.Header.Get("X-Request-Id")] = seen{at: at, calls: llCmdCalls(info, "evalsha") - base.Load(), err: err}
		mu.Unlock()
	}
	r.onArrival.Store(&check)
	defer r.onArrival.Store(nil)

	res := llAuditResult{onBefore: map[int64]int{}, offBefore: map[int64]int{}, connSetup: map[string]int{}}
	onTotal := map[string]int64{} // EVALSHA calls per limited request, settlement included
	skipped := map[string]bool{}
	cl := benchClient()
	for i := 0; res.on < n || res.off < n; i++ {
		on := i%2 == 0
		tok := r.off.Token
		if on {
			tok = onTok
		}
		base.Store(rc.evalshaCalls(tb))
		id, st, err := llChat(cl, p.URL, tok)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		// Settlements only: Drain would also give the quota slices back,
		// and the sliced audit measures requests that fit held slices.
		require.NoError(tb, p.DP.DrainSettlements(ctx), "settlement pending")
		cancel()
		if on && st == http.StatusServiceUnavailable && strings.Contains(err.Error(), `"`+dataplane.CodeLimitsUnavailable+`"`) {
			skipped[id] = true
			require.Less(tb, len(skipped), max(n/10, 3), "too many admissions over the limits call timeout")
			continue
		}
		require.NoError(tb, err)
		total := rc.evalshaCalls(tb) - base.Load()
		mu.Lock()
		a, ok := arrivals[id]
		mu.Unlock()
		require.True(tb, ok, "request %s never reached the upstream", id)
		require.NoError(tb, a.err, "INFO at the upstream")
		if on {
			res.on++
			onTotal[id] = total
			res.onBefore[a.calls]++
		} else {
			res.off++
			if !sliced { // with slices, the worker's calls may fall within a request
				require.Zero(tb, a.calls, "request %s (no limits) called Redis before forwarding", id)
				require.Zero(tb, total, "request %s (no limits) called Redis", id)
			}
			res.offBefore[a.calls]++
		}
	}
	res.skipped = len(skipped)

	lines := mon.sync(tb, rc)[start:]
	mine := rc.localAddr()
	type calls struct{ admit, settle, renew []time.Time }
	byID := map[string]*calls{}
	var other []string
	for _, l := range lines {
		if l.src == "lua" || l.src == mine {
			continue
		}
		cmd := strings.ToLower(l.args[0])
		if cmd == "ping" && sliced {
			res.pings++ // the slice worker's heartbeat
			continue
		}
		if llConnSetupCommands[cmd] {
			res.connSetup[strings.Join(l.args[:min(2, len(l.args))], " ")]++
			continue
		}
		if cmd == "zrange" && len(l.args) > 1 && (strings.HasSuffix(l.args[1], "}:leases") || strings.HasSuffix(l.args[1], "}:bhx")) {
			res.sweepScans++
			continue
		}
		if cmd == "eval" && sliced && len(l.args) > 1 && strings.Contains(l.args[1], "-- carve.lua") {
			res.sliceCalls++ // the script's first call on this Redis
			continue
		}
		if cmd != "evalsha" || len(l.args) < 3 {
			other = append(other, strings.Join(l.args, " "))
			continue
		}
		nkeys, err := strconv.Atoi(l.args[2])
		if err != nil || len(l.args) < 4+nkeys {
			other = append(other, strings.Join(l.args, " "))
			continue
		}
		at := l.at
		call := func(id string) *calls {
			c := byID[id]
			if c == nil {
				c = &calls{}
				byID[id] = c
			}
			return c
		}
		argv := l.args[3+nkeys:]
		switch l.args[1] {
		case carveSHA:
			res.sliceCalls++
		case admitSHA:
			// A batch of one org's admissions (admit.lua's header).
			ids, err := llAdmitIDs(argv)
			if err != nil {
				other = append(other, "admit "+err.Error())
			}
			for _, id := range ids {
				c := call(id)
				c.admit = append(c.admit, at)
			}
		case renewSHA:
			c := call(argv[0])
			c.renew = append(c.renew, at)
		case settleSHA:
			// A batch: the request ids are at the head of each request's
			// ARGV entries (settle.lua's header).
			ids, err := llSettleIDs(argv)
			if err != nil {
				other = append(other, "settle "+err.Error())
			}
			for _, id := range ids {
				c := call(id)
				c.settle = append(c.settle, at)
			}
		default:
			other = append(other, "evalsha "+l.args[1])
		}
	}
	require.Empty(tb, other, "Redis commands of the proxy that are neither an admission, a renewal nor a settlement")
	for id, c := range byID {
		if skipped[id] {
			continue
		}
		total, ok := onTotal[id]
		require.True(tb, ok, "Redis call for request %s, not one of the limited key's", id)
		require.Len(tb, c.admit, 1, "admissions of %s", id)
		require.NotEmpty(tb, c.settle, "settlements of %s", id)
		a := arrivals[id]
		renewedBefore := int64(0)
		for _, at := range c.renew {
			if at.Before(a.at) {
				renewedBefore++
			}
		}
		if !sliced { // INFO counts the slice worker's calls too
			require.Equal(tb, 1+renewedBefore, a.calls, "request %s: EVALSHA calls before the upstream saw it", id)
			require.Equal(tb, int64(len(c.admit)+len(c.settle)+len(c.renew)), total, "request %s: EVALSHA calls in all", id)
		}
		require.True(tb, c.admit[0].Before(a.at), "request %s: admitted at %s, at the upstream at %s", id, c.admit[0], a.at)
		require.True(tb, a.at.Before(c.settle[0]), "request %s: settled at %s before it reached the upstream at %s", id, c.settle[0], a.at)
		res.admitToUpstream = max(res.admitToUpstream, a.at.Sub(c.admit[0]))
		res.settleRetries += len(c.settle) - 1
		res.renewals += len(c.renew)
	}
	require.Len(tb, onTotal, res.on)
	for id := range onTotal {
		if _, ok := byID[id]; !ok && sliced {
			res.local++
			continue
		}
		require.Contains(tb, byID, id, "limited request %s made no Redis call", id)
	}
	if !sliced {
		require.Zero(tb, res.sliceCalls, "slice calls of a data plane without slices")
	}
	return res
}

// llSettleIDs returns the request ids settled by one settle.lua call
// (its ARGV; the layout is in settle.lua's header).
func llSettleIDs(argv []string) ([]string, error) {
	if len(argv) < 5 {
		return nil, fmt.Errorf("%d arguments", len(argv))
	}
	n, err1 := strconv.Atoi(argv[3])
	m, err2 := strconv.Atoi(argv[4])
	if err1 != nil || err2 != nil || len(argv) < 7 {
		return nil, fmt.Errorf("bad header %v", argv[:5])
	}
	var ids []string
	a := 7 + m // rate window, bucket, tombstone TTL, R, m, mode, index, thresholds
	for range n {
		if a+4 > len(argv) {
			return ids, fmt.Errorf("truncated at request %d", len(ids)+1)
		}
		k, err := strconv.Atoi(argv[a+3])
		if err != nil {
			return ids, fmt.Errorf("bad scope count %q", argv[a+3])
		}
		ids = append(ids, argv[a])
		a += 4 + 8*k // 8 values per scope (settle.lua)
	}
	if a != len(argv) {
		return ids, fmt.Errorf("%d arguments, read %d", len(argv), a)
	}
	return ids, nil
}

// llAdmitIDs returns the request ids of an admit.lua call's ARGV.
func llAdmitIDs(argv []string) ([]string, error) {
	if len(argv) < 7 {
		return nil, fmt.Errorf("%d arguments", len(argv))
	}
	n, err := strconv.Atoi(argv[6])
	if err != nil {
		return nil, fmt.Errorf("bad header %v", argv[:7])
	}
	var ids []string
	a := 7 // lease TTL, quarantine, record TTL, parallel retry max, window, bucket, R
	for range n {
		if a+5 > len(argv) {
			return ids, fmt.Errorf("truncated at request %d", len(ids)+1)
		}
		k, err := strconv.Atoi(argv[a+4])
		if err != nil {
			return ids, fmt.Errorf("bad scope count %q", argv[a+4])
		}
		ids = append(ids, argv[a])
		a += 5 + 7*k + 4 // 7 values per scope, then the report and 3 prefill values
	}
	if a != len(argv) {
		return ids, fmt.Errorf("%d arguments, read %d", len(argv), a)
	}
	return ids, nil
}

// TestLimitsOneRoundTrip is the normal-run smoke test of the overhead
// benchmark's round-trip property: a key without limits makes no Redis
// call; a key limited at key, team and org level (rpm, tpm, parallel,
// budget) makes exactly one EVALSHA before the upstream sees the request
// and one after, nothing else.
func TestLimitsOneRoundTrip(t *testing.T) {
	t.Parallel()
	r := llSetupRig(t, startDist(t))
	res := r.audit(t, 10)
	t.Logf("round trips: %d requests without limits: EVALSHA calls before the upstream saw them %v, no Redis command at all; "+
		"%d limited requests: EVALSHA calls before the upstream saw them %v, 1 admit + 1 settle each, nothing else "+
		"(settle retries %d, renewals %d, left out after 503 limits_unavailable %d); largest admission→upstream delay %s; "+
		"connection handshakes during the audit %v",
		res.off, res.offBefore, res.on, res.onBefore, res.settleRetries, res.renewals, res.skipped,
		res.admitToUpstream.Round(time.Microsecond), res.connSetup)
}

// TestLimitsSlicesZeroRoundTrips is the round-trip audit through a data
// plane with quota slices on (issue 15): a key limited at key, team and org
// level by rpm and tpm, and the "on" key limited at each level by every
// kind (rpm, tpm, concurrency and a budget), far from their limits, are
// admitted and settled without any Redis call on the request path once
// their scopes hold slices; only the slice worker talks to Redis (a few
// carve.lua calls per second, for all scopes of the org in one call).
func TestLimitsSlicesZeroRoundTrips(t *testing.T) {
	t.Parallel()
	r := llSetupRig(t, startDist(t))
	r.addSliced(t)
	for _, k := range []struct {
		name, tok string
	}{{"rpm/tpm only", r.rate.Token}, {"every kind", r.on.Token}} {
		res := r.auditSliced(t, 200, k.tok)
		t.Logf("slices, %s: %d limited requests, %d without any Redis call, the rest admitted exactly %v; slice worker calls during the audit %d, heartbeats %d; "+
			"%d requests without limits; connection handshakes %v",
			k.name, res.on, res.local, res.onBefore, res.sliceCalls, res.pings, res.off, res.connSetup)
	}
}

// llResult is one measurement of one key.
type llResult struct {
	p50, p99 time.Duration
	rps      float64
	// evalshaPerReq and redisCPUPerReq are Redis's EVALSHA calls and CPU per
	// request at c=64.
	evalshaPerReq float64
	evalsha       int64 // EVALSHA calls at c=64
	admitted      int64 // requests answered 200 at c=64
	// settleRetries counts settle calls that failed (and were retried).
	settleRetries int64
	// redisUsecPerCall is Redis's own execution time per EVALSHA
	// (INFO commandstats usec / calls) at c=64.
	redisUsecPerCall float64
	redisCPUPerReq   time.Duration
	// redisNetPerReq is redisCPUPerReq less the background's share
	// (llRig.redisIdle over the phase's duration).
	redisNetPerReq time.Duration
	cpuPerReq      time.Duration // the benchmark process (proxy, client, upstream)
	proxyCPUPerReq time.Duration // the binary data plane's process (llRig.pb), else 0
	// machinePerReq is the whole machine's busy CPU per request at c=64
	// (every process: the benchmark, redis-server, NATS, the control
	// plane, Postgres); infraPerReq NATS's, the control plane's and
	// Postgres's.
	machinePerReq time.Duration
	infraPerReq   infraCPU
	// stealShare is the share of the machine's cores the hypervisor gave
	// to other guests during the key's turns at c=64 (machineStat's steal over
	// the turns' wall time × cores).
	stealShare float64
	// cmdsPerWrite is how many commands shared one write to Redis at c=64
	// (the data plane's pipelining; 0 when it sent none).
	cmdsPerWrite float64
	// unavailable counts 503 limits_unavailable answers (not in rps).
	unavailable int64
	// sliceCalls counts the slice worker's carve.lua calls at c=64 (not
	// in evalsha).
	sliceCalls int64
	// trickleUnavailable counts the background trickle's requests answered
	// 503 limits_unavailable at c=64 (their calls are not in evalsha).
	trickleUnavailable int64
	// turns is the key's turns at c=64 (measureGroup): a trickle request
	// straddling a turn's end may put its calls in either turn.
	turns int64
	// allocsPerReq and bytesPerReq are the benchmark process's heap
	// allocations per request at c=64 (data plane, client, upstream).
	allocsPerReq, bytesPerReq float64
}

// sliceCalls is the slice worker's carve.lua calls so far (0 without the
// sliced data plane).
func (r *llRig) sliceCalls() int64 {
	if r.ps == nil {
		return 0
	}
	return r.ps.DP.LimitSliceStats().CarveCalls
}

// llTurn is one key's turn in an interleaved measurement (measureGroup):
// the keys of a group take turns of this length until each has had
// llBenchLoad. A key waits two turns for its next one: that idle gap stays
// under limits.DefaultSliceLinger (500 ms), after which a scope gives back
// its free budget and concurrency slices, so that each turn does not start
// with exact admissions until the next carve, as steady traffic would not
// (with half-second turns the every-kind key made 0.002–0.003 EVALSHA per
// request, with 150 ms turns 0.001).
const llTurn = 150 * time.Millisecond

// llClient is the load client of a measured group.
type llClient int

const (
	// llClientGo is net/http's client: it parses every answer's header
	// fields into a map (two allocations per field it does not know by
	// heart), so the limited keys' six x-ratelimit-* fields cost the
	// client, which shares the cores, about as much as the data plane.
	llClientGo llClient = iota
	// llClientRaw is a wrk-like client (internal/rawhttp): pre-built
	// requests, answers read without a header map. The first
	// measurements were taken with wrk.
	llClientRaw
)

func (c llClient) String() string {
	if c == llClientRaw {
		return "raw (wrk-like)"
	}
	return "net/http"
}

// llSample is what measureGroup reads at each turn's end.
type llSample struct {
	at                    time.Time
	done                  int64 // requests answered 200 at c=64
	cpu, redisCPU         time.Duration
	machine               time.Duration // machineBusy
	steal                 time.Duration // machineStat's steal
	infra                 infraCPU
	evalsha, evalshaUsec  int64
	trickled, trickleUnav int64
	sliceCalls            int64
	mallocs, allocBytes   uint64        // the benchmark process's (runtime.MemStats)
	proxyCPU              time.Duration // the binary data plane's (llRig.pb), when measured
}

// measureGroup measures the keys toks through p, interleaved: at c=1 their
// requests alternate one by one, and at c=64 they take turns of llTurn
// (the same 64 connections; whatever a turn costs the process and Redis
// is the key's). A shared VM's speed drifts by 2× over minutes here, so
// keys measured one after the other for seconds each compare the machine
// as much as the keys; short turns compare the keys.
// The settle retries and the pipelining figures are the group's.
func (r *llRig) measureGroup(tb testing.TB, p *proxy, toks []string, rc *llRESP, settle func(), client llClient) []llResult {
	tb.Helper()
	res := make([]llResult, len(toks))
	unavailable := make([]atomic.Int64, len(toks))
	settle()
	// do sends one request of key i on worker w's connection.
	var do func(w, i int) error
	// dialRest opens the connections of workers 1 and up (wrk-like
	// client) just before the c=64 phase: a connection opened earlier
	// would wait out the warm-up and the c=1 phase without a request, and
	// a server closes a connection whose first request does not come
	// within its read-header timeout (the data plane's default is 10 s;
	// the likely cause of a run on a disturbed machine whose first c=64
	// request on such a connection read EOF).
	dialRest := func() {}
	switch client {
	case llClientGo:
		c := benchClient()
		defer c.CloseIdleConnections()
		do = func(_, i int) error { _, _, err := llChat(c, p.URL, toks[i]); return err }
	case llClientRaw:
		host := strings.TrimPrefix(p.URL, "http://")
		reqs := make([][]byte, len(toks))
		for i, tok := range toks {
			reqs[i] = rawhttp.Request(http.MethodPost, host, "/v1/chat/completions",
				[][2]string{{"Content-Type", "application/json"}, {"Authorization", "Bearer " + tok}}, []byte(benchChatBody))
		}
		conns := make([]*rawhttp.Conn, llBenchConcurrency)
		defer func() {
			for _, c := range conns {
				if c != nil {
					_ = c.Close()
				}
			}
		}()
		dial := func(w int) {
			c, err := rawhttp.Dial(host)
			require.NoError(tb, err)
			conns[w] = c
		}
		dial(0)
		dialRest = func() {
			for w := 1; w < len(conns); w++ {
				dial(w)
			}
		}
		do = func(w, i int) error {
			st, body, err := conns[w].Do(reqs[i])
			if err == nil && st != http.StatusOK {
				err = fmt.Errorf("status %d: %s", st, body)
			}
			return err
		}
	}
	// chat sends one request of key i; a 503 limits_unavailable (a limits
	// call over its 50 ms timeout: the proxy fails closed) is counted, not
	// fatal.
	chat := func(w, i int) (ok bool, err error) {
		err = do(w, i)
		if err != nil && strings.Contains(err.Error(), `"`+dataplane.CodeLimitsUnavailable+`"`) {
			unavailable[i].Add(1)
			return false, nil
		}
		return err == nil, err
	}
	for range 200 {
		for i := range toks {
			_, err := chat(0, i)
			require.NoError(tb, err, "warm-up, key %d", i)
		}
	}
	lat := make([][]time.Duration, len(toks))
	for range llBenchSeq {
		for i := range toks {
			t0 := time.Now()
			ok, err := chat(0, i)
			require.NoError(tb, err, "c=1, key %d", i)
			if ok {
				lat[i] = append(lat[i], time.Since(t0))
			}
		}
	}
	for i := range toks {
		res[i].p50, res[i].p99 = harness.Percentile(lat[i], 50), harness.Percentile(lat[i], 99)
	}
	settle()
	dialRest()

	var done atomic.Int64
	var cur atomic.Int32
	var failed atomic.Value
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sf0 := llMetric(tb, p, `sluice_proxy_limits_unavailable_total{op="settle"}`)
	cmds0, writes0 := llMetric(tb, p, "sluice_limits_store_commands_total"), llMetric(tb, p, "sluice_limits_store_writes_total")
	// The binary data plane's own CPU (a process of its own: the bench
	// process's CPU is then the client's and the upstream's).
	proxyCPU := func() time.Duration { return 0 }
	if p == r.pb {
		proxyCPU = func() time.Duration { return procCPU(r.pbPid) }
	}
	sample := func() llSample {
		ev, usec := rc.evalshaStats(tb)
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		var inf infraCPU
		if r.infra != nil {
			inf = r.infra()
		}
		busy, steal := machineStat()
		return llSample{at: time.Now(), done: done.Load(), cpu: cpuTime(), machine: busy, steal: steal, infra: inf, redisCPU: rc.redisCPU(tb), evalsha: ev, evalshaUsec: usec,
			trickled: r.trickled.Load(), trickleUnav: r.trickleUnavailable.Load(), sliceCalls: r.sliceCalls(),
			mallocs: ms.Mallocs, allocBytes: ms.TotalAlloc, proxyCPU: proxyCPU()}
	}
	// SLUICE_BENCH_CPUPROFILE=file profiles the first c=64 phase with the
	// limited key (the data plane, client and upstream of this process).
	var profiling bool
	if path := os.Getenv("SLUICE_BENCH_CPUPROFILE"); path != "" && slices.Contains(toks, r.on.Token) && !r.profiled {
		f, err := os.Create(path)
		require.NoError(tb, err)
		defer f.Close()
		require.NoError(tb, pprof.StartCPUProfile(f))
		profiling, r.profiled = true, true
	}
	acc := make([]struct {
		elapsed time.Duration
		d       llSample // the sums of the differences over the key's turns
	}, len(toks))
	// Between turns the workers pause (gate) until the turn's requests
	// have been answered and settled, so that no Redis call of one key is
	// counted in another's turn.
	var gate atomic.Pointer[chan struct{}]
	var inflight atomic.Int64
	prev := sample()
	var wg sync.WaitGroup
	for w := range llBenchConcurrency {
		wg.Go(func() {
			for ctx.Err() == nil {
				if g := gate.Load(); g != nil {
					select {
					case <-*g:
					case <-ctx.Done():
					}
					continue
				}
				inflight.Add(1)
				if gate.Load() != nil { // paused meanwhile: the pauser may have seen no request in flight
					inflight.Add(-1)
					continue
				}
				key := int(cur.Load())
				ok, err := chat(w, key)
				inflight.Add(-1)
				if err != nil {
					failed.Store(fmt.Errorf("c=%d, worker %d, key %d: %w", llBenchConcurrency, w, key, err))
					cancel()
					return
				}
				if ok {
					done.Add(1)
				}
			}
		})
	}
	perKey := max(1, int(llBenchLoad/llTurn))
	for k := range len(toks) * perKey {
		i := k % len(toks)
		select {
		case <-ctx.Done():
		case <-time.After(llTurn):
		}
		ch := make(chan struct{})
		gate.Store(&ch)
		for inflight.Load() > 0 && ctx.Err() == nil {
			time.Sleep(100 * time.Microsecond) // the turn's last answers: a few ms at most
		}
		if p.DP != nil { // the binary's settlements from slices are local
			dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
			require.NoError(tb, p.DP.DrainSettlements(dctx))
			dcancel()
		}
		s := sample()
		cur.Store(int32((k + 1) % len(toks)))
		gate.Store(nil)
		close(ch)
		a := &acc[i]
		a.elapsed += s.at.Sub(prev.at)
		a.d.done += s.done - prev.done
		a.d.cpu += s.cpu - prev.cpu
		a.d.machine += s.machine - prev.machine
		a.d.steal += s.steal - prev.steal
		a.d.infra.nats += s.infra.nats - prev.infra.nats
		a.d.infra.control += s.infra.control - prev.infra.control
		a.d.infra.postgres += s.infra.postgres - prev.infra.postgres
		a.d.redisCPU += s.redisCPU - prev.redisCPU
		a.d.evalsha += s.evalsha - prev.evalsha
		a.d.evalshaUsec += s.evalshaUsec - prev.evalshaUsec
		a.d.trickled += s.trickled - prev.trickled
		a.d.trickleUnav += s.trickleUnav - prev.trickleUnav
		a.d.sliceCalls += s.sliceCalls - prev.sliceCalls
		a.d.mallocs += s.mallocs - prev.mallocs
		a.d.allocBytes += s.allocBytes - prev.allocBytes
		a.d.proxyCPU += s.proxyCPU - prev.proxyCPU
		prev = s
	}
	cancel()
	wg.Wait()
	if profiling {
		pprof.StopCPUProfile()
	}
	if p.DP != nil {
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
		require.NoError(tb, p.DP.Drain(dctx))
		dcancel()
	}
	if err, _ := failed.Load().(error); err != nil {
		tb.Fatal(err)
	}
	settleRetries := llMetric(tb, p, `sluice_proxy_limits_unavailable_total{op="settle"}`) - sf0
	var cmdsPerWrite float64
	if w := llMetric(tb, p, "sluice_limits_store_writes_total") - writes0; w > 0 {
		cmdsPerWrite = float64(llMetric(tb, p, "sluice_limits_store_commands_total")-cmds0) / float64(w)
	}
	for i := range toks {
		a, x := acc[i], &res[i]
		n := a.d.done
		require.Positive(tb, n, "requests answered at c=%d", llBenchConcurrency)
		x.rps = float64(n) / a.elapsed.Seconds()
		x.cpuPerReq = a.d.cpu / time.Duration(n)
		x.proxyCPUPerReq = a.d.proxyCPU / time.Duration(n)
		x.machinePerReq = a.d.machine / time.Duration(n)
		x.stealShare = float64(a.d.steal) / float64(a.elapsed*time.Duration(runtime.NumCPU()))
		x.infraPerReq = a.d.infra.div(n)
		// The trickle's requests are 2 EVALSHA each, admitted or timed
		// out (admission and settlement, or admission and cancellation;
		// one may straddle a turn's end: the bounds allow for it). Before
		// the timed-out ones were counted, a loaded run's "off" phase
		// failed its bound (6 and 12 calls besides the trickle against
		// 2): two per trickle request answered 503 limits_unavailable.
		x.sliceCalls = a.d.sliceCalls
		x.trickleUnavailable = a.d.trickleUnav
		x.evalsha = a.d.evalsha - 2*(a.d.trickled+a.d.trickleUnav) - a.d.sliceCalls
		x.admitted = n
		// The group's: a failed settlement is not told apart by key.
		x.settleRetries = settleRetries
		if x.evalsha > 0 {
			x.redisUsecPerCall = float64(a.d.evalshaUsec) / float64(x.evalsha)
		}
		x.evalshaPerReq = float64(x.evalsha) / float64(n)
		x.redisCPUPerReq = a.d.redisCPU / time.Duration(n)
		x.redisNetPerReq = max(a.d.redisCPU-time.Duration(r.redisIdle*a.elapsed.Seconds()), 0) / time.Duration(n)
		x.unavailable = unavailable[i].Load()
		x.cmdsPerWrite = cmdsPerWrite
		x.turns = int64(perKey)
		x.allocsPerReq = float64(a.d.mallocs) / float64(n)
		x.bytesPerReq = float64(a.d.allocBytes) / float64(n)
	}
	return res
}

// llTrickle is the background traffic of the limited key during the
// benchmark: one request every 50 ms, so that its rpm and tpm windows hold
// a request in every 1 s bucket, as under sustained production traffic.
// admit.lua reads every live bucket of every window it checks, so its cost
// depends on how full the windows are; without the trickle the windows
// would fill and drain with the phases of the benchmark.
const llTrickle = 50 * time.Millisecond

func BenchmarkLimitsOverhead(b *testing.B) {
	// The proxies run in this process, as `sluice proxy` does with its
	// heap floor (--gc-heap-floor, internal/gctune); the floor applies to
	// the whole process, load client included. SLUICE_BENCH_GC_HEAP_FLOOR
	// sets another (bytes; 0: GOGC alone).
	floor := int64(dataplane.DefaultGCHeapFloor)
	if v := os.Getenv("SLUICE_BENCH_GC_HEAP_FLOOR"); v != "" {
		var err error
		floor, err = strconv.ParseInt(v, 10, 64)
		require.NoError(b, err, "SLUICE_BENCH_GC_HEAP_FLOOR")
	}
	if floor > 0 {
		stopGC, err := gctune.Start(uint64(floor))
		require.NoError(b, err)
		defer stopGC()
	}
	defer func() {
		p, n := gctune.Percent()
		b.Logf("heap floor %d bytes (SLUICE_BENCH_GC_HEAP_FLOOR; 0: GOGC alone): GOGC %d at the end, changed %d times", floor, p, n)
	}()
	d, infra := startBenchInfra(b)
	r := llSetupRig(b, d)
	r.infra = infra
	audit := r.audit(b, llBenchAudit)
	// Quota slices (issue 15): a second data plane with --limit-slices on
	// the same Redis, and a tenant limited by rpm and tpm only.
	r.addSliced(b)
	sliceAudit := r.auditSliced(b, llBenchAudit, r.on.Token)
	r.addSlicedBinary(b)

	rc, err := llDialRESP(r.redis.addr)
	require.NoError(b, err)
	defer rc.close()

	trickleCtx, stopTrickle := context.WithCancel(context.Background())
	trickleDone := make(chan struct{})
	go func() {
		defer close(trickleDone)
		c, t := benchClient(), time.NewTicker(llTrickle)
		defer t.Stop()
		for {
			select {
			case <-trickleCtx.Done():
				return
			case <-t.C:
			}
			// The "on" key only: the EVALSHA accounting of the phases
			// assumes one trickle request per tick (the rate-only key's
			// windows are therefore not kept full: its exact baseline
			// is, if anything, flattered).
			switch _, _, err := llChat(c, r.p.URL, r.on.Token); {
			case err == nil:
				r.trickled.Add(1)
			case strings.Contains(err.Error(), `"`+dataplane.CodeLimitsUnavailable+`"`):
				r.trickleUnavailable.Add(1)
			}
		}
	}()
	defer func() { stopTrickle(); <-trickleDone }()
	// Full windows: 61 buckets of 1 s (docs/limits.md) since the trickle
	// started, and the key's rpm window holds them.
	rpmKey := "llb:{o:" + r.on.OrgID + "}:lim:key:" + r.on.KeyID
	time.Sleep(62 * time.Second)
	// The requests window's buckets are the fields r<bucket> of the key's
	// state hash (EVAL, not EVALSHA: the benchmark counts EVALSHA calls).
	nb, err := rc.do("EVAL", "local n = 0 for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do "+
		"if string.match(f, '^r%d+$') then n = n + 1 end end return n", "1", rpmKey)
	require.NoError(b, err)
	buckets, _ := strconv.Atoi(nb)
	require.GreaterOrEqual(b, buckets, 58, "live 1 s buckets in %s", rpmKey)
	r.measureRedisIdle(b, rc, 5*time.Second)
	ctx := context.Background()
	pg, err := pgx.Connect(ctx, d.DatabaseURL)
	require.NoError(b, err)
	defer pg.Close(ctx)
	// settle: before each phase, the ledger has caught up with the one
	// before (as in BenchmarkProxyOverhead). The trickle (llTrickle) keeps
	// adding a row every 50 ms, so "caught up" is: nothing buffered or
	// spooled, and the ledger grew by no more than the trickle's requests
	// since the last look (before, a ledger that never stopped growing made
	// every phase wait out the whole minute, and 5 rounds the 20 min timeout).
	settle := func() {
		infra() // lowers the priority of new Postgres backends
		deadline := time.Now().Add(time.Minute)
		last, lastTrickled := int64(-1), int64(0)
		for time.Now().Before(deadline) {
			var n int64
			// Requests answered 503 are in the ledger too.
			trickled := r.trickled.Load() + r.trickleUnavailable.Load()
			require.NoError(b, pg.QueryRow(ctx, `SELECT count(*) FROM spend_logs`).Scan(&n))
			st := r.p.DP.UsageStats()
			if st.Buffered == 0 && st.SpoolBytes == 0 && last >= 0 && n-last <= trickled-lastTrickled+1 {
				return
			}
			last, lastTrickled = n, trickled
			time.Sleep(200 * time.Millisecond)
		}
	}
	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	var off, on []llResult
	// The quota-slice phases: the "on" key (every kind of limit, all from
	// slices) and the rate-only key, through the sliced data plane; each
	// key through the exact one is its baseline.
	var onSliced, rateExact, rateSliced []llResult
	// offSliced is the key without limits through the sliced data plane:
	// the baseline of the sliced phases on the same data plane (the
	// exact one's "off" is reported against too).
	var offSliced []llResult
	// Two groups, each measured interleaved (measureGroup): the three keys
	// through the exact data plane, and the same three through the sliced
	// one; each round alternates which goes first, so no group always runs
	// on a warmer (or more loaded) machine.
	// A third group is the sliced data plane's three keys again, loaded by
	// the wrk-like client (llClientRaw) instead of net/http's: the same
	// keys and data plane, without the client's cost of parsing the
	// limited answers' six header fields on the same cores.
	var offRaw, onRaw, rateRaw []llResult
	// A fourth group is the same three keys through the sliced data plane
	// as a process of its own (`sluice proxy`, llRig.pb), loaded by the
	// wrk-like client: the proxy with its own heap and GC (its heap floor,
	// --gc-heap-floor), as deployed, not sharing them with the client.
	var offBin, onBin, rateBin []llResult
	type group struct {
		p      *proxy
		toks   []string
		outs   []*[]llResult
		client llClient
	}
	groups := []group{
		{r.p, []string{r.off.Token, r.on.Token, r.rate.Token}, []*[]llResult{&off, &on, &rateExact}, llClientGo},
		{r.ps, []string{r.off.Token, r.on.Token, r.rate.Token}, []*[]llResult{&offSliced, &onSliced, &rateSliced}, llClientGo},
		{r.ps, []string{r.off.Token, r.on.Token, r.rate.Token}, []*[]llResult{&offRaw, &onRaw, &rateRaw}, llClientRaw},
		{r.pb, []string{r.off.Token, r.on.Token, r.rate.Token}, []*[]llResult{&offBin, &onBin, &rateBin}, llClientRaw},
	}
	for range b.N {
		for i := range rounds {
			for j := range groups {
				g := groups[(i+j)%len(groups)] // each group goes first in turn
				for k, x := range r.measureGroup(b, g.p, g.toks, rc, settle, g.client) {
					*g.outs[k] = append(*g.outs[k], x)
				}
			}
		}
	}
	med := func(rs []llResult, f func(llResult) float64) float64 {
		v := make([]float64, len(rs))
		for i, x := range rs {
			v[i] = f(x)
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	fig := func(rs []llResult) llResult {
		d := func(f func(llResult) time.Duration) time.Duration {
			return time.Duration(med(rs, func(x llResult) float64 { return float64(f(x)) }))
		}
		return llResult{
			p50: d(func(x llResult) time.Duration { return x.p50 }), p99: d(func(x llResult) time.Duration { return x.p99 }),
			rps:            med(rs, func(x llResult) float64 { return x.rps }),
			evalshaPerReq:  med(rs, func(x llResult) float64 { return x.evalshaPerReq }),
			redisCPUPerReq: d(func(x llResult) time.Duration { return x.redisCPUPerReq }),
			redisNetPerReq: d(func(x llResult) time.Duration { return x.redisNetPerReq }),
			cpuPerReq:      d(func(x llResult) time.Duration { return x.cpuPerReq }),
			machinePerReq:  d(func(x llResult) time.Duration { return x.machinePerReq }),
			infraPerReq: infraCPU{nats: d(func(x llResult) time.Duration { return x.infraPerReq.nats }),
				control:  d(func(x llResult) time.Duration { return x.infraPerReq.control }),
				postgres: d(func(x llResult) time.Duration { return x.infraPerReq.postgres })},
			redisUsecPerCall: med(rs, func(x llResult) float64 { return x.redisUsecPerCall }),
			cmdsPerWrite:     med(rs, func(x llResult) float64 { return x.cmdsPerWrite }),
			allocsPerReq:     med(rs, func(x llResult) float64 { return x.allocsPerReq }),
			bytesPerReq:      med(rs, func(x llResult) float64 { return x.bytesPerReq }),
		}
	}
	fo, fn := fig(off), fig(on)
	for _, x := range off {
		fo.unavailable += x.unavailable
	}
	for _, x := range on {
		fn.unavailable += x.unavailable
	}
	fos, fre, frs, fso := fig(onSliced), fig(rateExact), fig(rateSliced), fig(offSliced)
	fro, fon, frr := fig(offRaw), fig(onRaw), fig(rateRaw)
	fbo, fbn, fbr := fig(offBin), fig(onBin), fig(rateBin)
	for _, f := range []struct {
		f  *llResult
		rs []llResult
	}{{&fbo, offBin}, {&fbn, onBin}, {&fbr, rateBin}} {
		f.f.proxyCPUPerReq = time.Duration(med(f.rs, func(x llResult) float64 { return float64(x.proxyCPUPerReq) }))
		for _, x := range f.rs {
			f.f.unavailable += x.unavailable
		}
	}
	for _, p := range []struct {
		f  *llResult
		rs []llResult
	}{{&fos, onSliced}, {&fre, rateExact}, {&frs, rateSliced}, {&fso, offSliced}, {&fro, offRaw}, {&fon, onRaw}, {&frr, rateRaw}} {
		for _, x := range p.rs {
			p.f.unavailable += x.unavailable
			p.f.sliceCalls += x.sliceCalls
		}
	}
	us := func(d time.Duration) string { return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond)) }
	// The throughput ratio is the median of the rounds' own ratios: each
	// round measures off and on back to back, so a round's ratio is not
	// moved by the machine getting faster or slower between rounds (a
	// shared VM's throughput drifts by 2× over minutes here). The ratio of
	// the medians is reported too.
	ratios := make([]float64, len(off))
	for i := range off {
		ratios[i] = on[i].rps / off[i].rps
	}
	slices.Sort(ratios)
	ratio := ratios[len(ratios)/2]
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nround-trip audit: %d limited requests, EVALSHA calls before the upstream saw them %v, 1 admit + 1 settle each, nothing else "+
		"(settle retries %d, renewals %d, left out after 503 %d); %d requests without limits, no Redis command (%v); "+
		"largest admission→upstream delay %s; connection handshakes %v\n",
		audit.on, audit.onBefore, audit.settleRetries, audit.renewals, audit.skipped, audit.off, audit.offBefore,
		us(audit.admitToUpstream), audit.connSetup)
	fmt.Fprintf(&sb, "%d round(s), the groups (exact; sliced with net/http's client; sliced and the binary with the wrk-like one) in rotating order; within a group the three keys alternate request by request at c=1 "+
		"and take turns of %s at c=%d (%s each); medians; zero-latency upstream; NATS and control plane at nice %d; "+
		"limited key's windows in steady state (%d live 1 s buckets before the rounds; a request every %s throughout, not counted)\n",
		rounds*b.N, llTurn, llBenchConcurrency, llBenchLoad, infraNice(), buckets, llTrickle)
	fmt.Fprintf(&sb, "| limits | p50 (c=1) | p99 (c=1) | req/s (c=%d) | CPU/req (bench process) | EVALSHA/req | commands per write | redis-server CPU/req | 503 limits_unavailable (all rounds) |\n|---|---|---|---|---|---|---|---|---|\n", llBenchConcurrency)
	for _, x := range []struct {
		name string
		r    llResult
	}{{"off", fo}, {"on", fn}} {
		fmt.Fprintf(&sb, "| %s | %s | %s | %.0f | %s | %.3f | %.2f | %s | %d |\n", x.name, us(x.r.p50), us(x.r.p99), x.r.rps, us(x.r.cpuPerReq),
			x.r.evalshaPerReq, x.r.cmdsPerWrite, us(x.r.redisCPUPerReq), x.r.unavailable)
	}
	verdict := "meets the target"
	if ratio < 0.8 {
		verdict = "BELOW THE TARGET"
	}
	fmt.Fprintf(&sb, "on/off throughput %.3f×, the median of the rounds' ratios (target ≥ 0.8: %s); ratio of the medians %.3f×; added p50 %s; added p99 %s\n",
		ratio, verdict, fn.rps/fo.rps, us(fn.p50-fo.p50), us(fn.p99-fo.p99))
	// redis-server shares the machine's cores with the data plane here;
	// with Redis on its own host the data plane's CPU per request bounds
	// its throughput instead.
	fmt.Fprintf(&sb, "CPU per request: bench process off %s on %s (+%s); redis-server on %s, of which script execution %.0fµs per EVALSHA (INFO commandstats); "+
		"throughput ratio if only the bench process's CPU counted: %.3f×\n",
		us(fo.cpuPerReq), us(fn.cpuPerReq), us(fn.cpuPerReq-fo.cpuPerReq), us(fn.redisCPUPerReq), fn.redisUsecPerCall, float64(fo.cpuPerReq)/float64(fn.cpuPerReq))
	for i := range off {
		fmt.Fprintf(&sb, "round %d: req/s off %.0f on %.0f (%.3f×); CPU/req off %s on %s, redis %s; p50 off %s on %s (+%s)\n", i+1, off[i].rps, on[i].rps, on[i].rps/off[i].rps,
			us(off[i].cpuPerReq), us(on[i].cpuPerReq), us(on[i].redisCPUPerReq),
			us(off[i].p50), us(on[i].p50), us(on[i].p50-off[i].p50))
	}
	// Quota slices: each phase's paired ratio against the round's "off".
	fmt.Fprintf(&sb, "\nquota slices (issue 15; a second data plane with --limit-slices on the same Redis): audit of the \"on\" key (every kind): %d limited requests, "+
		"%d without any Redis call, the rest admitted exactly %v; slice worker calls during the audit %d\n",
		sliceAudit.on, sliceAudit.local, sliceAudit.onBefore, sliceAudit.sliceCalls)
	fmt.Fprintf(&sb, "redis-server CPU with only the background running (the trickle, idle data planes): %.1f ms per second; the whole machine's: %.1f ms per second\n",
		r.redisIdle/1e6, r.machineIdle/1e6)
	fmt.Fprintf(&sb, "steal (in the rounds below): the share of the machine's cores the hypervisor gave to other guests during a key's turns at c=%d "+
		"(/proc/stat; 0 on a machine of its own); machine CPU/req leaves it out\n", llBenchConcurrency)
	fmt.Fprintf(&sb, "| phase | data plane, load client | p50 (c=1) | added p50 | req/s (c=%d) | on/off, off through the same data plane (median of rounds; min–max) | "+
		"on/off, off through the exact data plane | CPU/req (bench process) | CPU/req (machine) | CPU/req (NATS, control plane, Postgres) | allocations/req (bench process) | EVALSHA/req | slice calls (all rounds) | redis-server CPU/req | of which not the background | 503 (all rounds) |\n"+
		"|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", llBenchConcurrency)
	paired := func(rs, base []llResult) string {
		rr := make([]float64, len(base))
		for i := range base {
			rr[i] = rs[i].rps / base[i].rps
		}
		slices.Sort(rr)
		return fmt.Sprintf("%.3f× (%.3f–%.3f)", rr[len(rr)/2], rr[0], rr[len(rr)-1])
	}
	for _, x := range []struct {
		name, plane string
		f           llResult
		rs, base    []llResult
		bf          llResult
	}{{"off", "sliced, net/http", fso, offSliced, offSliced, fso}, {"every kind, exact (on)", "exact, net/http", fn, on, off, fo},
		{"every kind, slices", "sliced, net/http", fos, onSliced, offSliced, fso},
		{"rpm/tpm only, exact", "exact, net/http", fre, rateExact, off, fo}, {"rpm/tpm only, slices", "sliced, net/http", frs, rateSliced, offSliced, fso},
		{"off", "sliced, raw (wrk-like)", fro, offRaw, offRaw, fro}, {"every kind, slices", "sliced, raw (wrk-like)", fon, onRaw, offRaw, fro},
		{"rpm/tpm only, slices", "sliced, raw (wrk-like)", frr, rateRaw, offRaw, fro},
		{"off", "binary, raw (wrk-like)", fbo, offBin, offBin, fbo}, {"every kind, slices", "binary, raw (wrk-like)", fbn, onBin, offBin, fbo},
		{"rpm/tpm only, slices", "binary, raw (wrk-like)", fbr, rateBin, offBin, fbo}} {
		fmt.Fprintf(&sb, "| %s | %s | %s | +%s | %.0f | %s | %s | %s | %s | %s, %s, %s | %.1f (%.1f KB) | %.3f | %d | %s | %s | %d |\n", x.name, x.plane, us(x.f.p50), us(x.f.p50-x.bf.p50), x.f.rps,
			paired(x.rs, x.base), paired(x.rs, off), us(x.f.cpuPerReq), us(x.f.machinePerReq),
			us(x.f.infraPerReq.nats), us(x.f.infraPerReq.control), us(x.f.infraPerReq.postgres), x.f.allocsPerReq, x.f.bytesPerReq/1024, x.f.evalshaPerReq, x.f.sliceCalls, us(x.f.redisCPUPerReq), us(x.f.redisNetPerReq), x.f.unavailable)
	}
	for i := range offSliced {
		fmt.Fprintf(&sb, "round %d, sliced data plane: req/s off %.0f, every kind %.0f (%.3f×), rpm/tpm only %.0f (%.3f×); CPU/req off %s, every kind %s, rpm/tpm only %s; machine CPU/req off %s, every kind %s, rpm/tpm only %s; steal off %.1f %%, every kind %.1f %%, rpm/tpm only %.1f %%\n", i+1,
			offSliced[i].rps, onSliced[i].rps, onSliced[i].rps/offSliced[i].rps, rateSliced[i].rps, rateSliced[i].rps/offSliced[i].rps,
			us(offSliced[i].cpuPerReq), us(onSliced[i].cpuPerReq), us(rateSliced[i].cpuPerReq),
			us(offSliced[i].machinePerReq), us(onSliced[i].machinePerReq), us(rateSliced[i].machinePerReq),
			100*offSliced[i].stealShare, 100*onSliced[i].stealShare, 100*rateSliced[i].stealShare)
	}
	for i := range offRaw {
		fmt.Fprintf(&sb, "round %d, sliced data plane, raw client: req/s off %.0f, every kind %.0f (%.3f×), rpm/tpm only %.0f (%.3f×); CPU/req off %s, every kind %s, rpm/tpm only %s; machine CPU/req off %s, every kind %s, rpm/tpm only %s; steal off %.1f %%, every kind %.1f %%, rpm/tpm only %.1f %%\n", i+1,
			offRaw[i].rps, onRaw[i].rps, onRaw[i].rps/offRaw[i].rps, rateRaw[i].rps, rateRaw[i].rps/offRaw[i].rps,
			us(offRaw[i].cpuPerReq), us(onRaw[i].cpuPerReq), us(rateRaw[i].cpuPerReq),
			us(offRaw[i].machinePerReq), us(onRaw[i].machinePerReq), us(rateRaw[i].machinePerReq),
			100*offRaw[i].stealShare, 100*onRaw[i].stealShare, 100*rateRaw[i].stealShare)
	}
	fmt.Fprintf(&sb, "the binary data plane (`sluice proxy`, a process of its own; the table's CPU/req (bench process) is then the client's and the upstream's): "+
		"its own CPU/req off %s, every kind %s (+%s), rpm/tpm only %s (+%s); allocations are the bench process's\n",
		us(fbo.proxyCPUPerReq), us(fbn.proxyCPUPerReq), us(fbn.proxyCPUPerReq-fbo.proxyCPUPerReq), us(fbr.proxyCPUPerReq), us(fbr.proxyCPUPerReq-fbo.proxyCPUPerReq))
	for i := range offBin {
		fmt.Fprintf(&sb, "round %d, binary data plane, raw client: req/s off %.0f, every kind %.0f (%.3f×), rpm/tpm only %.0f (%.3f×); proxy CPU/req off %s, every kind %s, rpm/tpm only %s; machine CPU/req off %s, every kind %s, rpm/tpm only %s; steal off %.1f %%, every kind %.1f %%, rpm/tpm only %.1f %%\n", i+1,
			offBin[i].rps, onBin[i].rps, onBin[i].rps/offBin[i].rps, rateBin[i].rps, rateBin[i].rps/offBin[i].rps,
			us(offBin[i].proxyCPUPerReq), us(onBin[i].proxyCPUPerReq), us(rateBin[i].proxyCPUPerReq),
			us(offBin[i].machinePerReq), us(onBin[i].machinePerReq), us(rateBin[i].machinePerReq),
			100*offBin[i].stealShare, 100*onBin[i].stealShare, 100*rateBin[i].stealShare)
	}
	// The paired ratios of the every-kind key through slices with each
	// client (issue 15's throughput target) as metrics.
	pairedMed := func(rs, base []llResult) float64 {
		rr := make([]float64, len(base))
		for i := range base {
			rr[i] = rs[i].rps / base[i].rps
		}
		slices.Sort(rr)
		return rr[len(rr)/2]
	}
	b.ReportMetric(pairedMed(onSliced, offSliced), "sliced_ratio")
	b.ReportMetric(pairedMed(onRaw, offRaw), "sliced_raw_ratio")
	b.ReportMetric(pairedMed(onBin, offBin), "binary_raw_ratio")
	b.Log(sb.String())
	b.ReportMetric(ratio, "throughput_ratio")
	b.ReportMetric(float64(fn.p50-fo.p50)/float64(time.Microsecond), "added_p50_us")
	b.ReportMetric(fo.rps, "off_rps")
	b.ReportMetric(fn.rps, "on_rps")
	// Under load too: one admission call per batch of at most 32 admitted
	// limited requests (admissions of one org are batched) and at most one
	// per request, and at most one settlement each (settlements of one org
	// are batched, so fewer), plus at most two per 503 limits_unavailable (an admission
	// that timed out, and the settlement cancelling it) and one per failed
	// settlement (retried); renewals only for requests older than the
	// renew interval, which these are not. None without limits.
	// Each key's turns end with its requests answered and settled
	// (measureGroup), so only a trickle request straddling a turn's end
	// (two calls) may land in another key's turn.
	for i := range on {
		x := on[i]
		require.GreaterOrEqual(b, x.evalsha, x.admitted/32-2*x.turns, "round %d: EVALSHA calls, limits on", i+1)
		require.LessOrEqual(b, x.evalsha, 2*x.admitted+2*x.unavailable+x.settleRetries+2*x.turns, "round %d: EVALSHA calls, limits on", i+1)
		// The off key's requests make none: what is left besides the
		// trickle's two per request is the straddle and the retries of
		// the trickle's failed settlements (settleRetries counts the
		// data plane's, and the off key has none of its own).
		for _, x := range []llResult{off[i], offSliced[i]} {
			require.LessOrEqual(b, x.evalsha, x.settleRetries+2*x.turns, "round %d: EVALSHA calls, limits off (besides the trickle; %d trickle requests 503, %d settle retries)",
				i+1, x.trickleUnavailable, x.settleRetries)
		}
		// Through the sliced data plane, both keys make almost no call
		// per request (the slice worker's calls are counted apart).
		x = onSliced[i]
		require.LessOrEqual(b, x.evalsha, x.admitted/10+2*x.unavailable+x.settleRetries+2*x.turns, "round %d: EVALSHA calls, every kind with slices", i+1)
		x = rateSliced[i]
		require.LessOrEqual(b, x.evalsha, x.admitted/10+2*x.unavailable+x.settleRetries+2*x.turns, "round %d: EVALSHA calls, rpm/tpm only with slices", i+1)
		x = onRaw[i]
		require.LessOrEqual(b, x.evalsha, x.admitted/10+2*x.unavailable+x.settleRetries+2*x.turns, "round %d: EVALSHA calls, every kind with slices, raw client", i+1)
		x = rateRaw[i]
		require.LessOrEqual(b, x.evalsha, x.admitted/10+2*x.unavailable+x.settleRetries+2*x.turns, "round %d: EVALSHA calls, rpm/tpm only with slices, raw client", i+1)
		require.LessOrEqual(b, offRaw[i].evalsha, offRaw[i].settleRetries+2*offRaw[i].turns, "round %d: EVALSHA calls, limits off, raw client", i+1)
	}
}
