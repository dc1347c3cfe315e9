package system

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Helpers of the Redis and proxy fault-injection tests of issue 5
// (limits_faults_e2e_test.go). Every identifier starts with "lf" so that
// these helpers never collide with other tests of the package.

// lfFreePort returns a loopback port that was free a moment ago.
func lfFreePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// lfRedis is a dedicated redis-server process (no persistence) on a port
// of its own: killing, freezing or restarting it affects only this test.
// A restart starts a new, empty process on the same port.
type lfRedis struct {
	t    testing.TB
	dir  string
	port int
	mu   sync.Mutex
	cmd  *exec.Cmd
}

func lfStartRedis(t testing.TB) *lfRedis {
	t.Helper()
	r := &lfRedis{t: t, dir: t.TempDir(), port: lfFreePort(t)}
	t.Cleanup(func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.cmd != nil {
			_ = r.cmd.Process.Signal(syscall.SIGCONT)
			_ = r.cmd.Process.Kill()
			_ = r.cmd.Wait()
			r.cmd = nil
		}
	})
	r.start()
	return r
}

func (r *lfRedis) addr() string { return "127.0.0.1:" + strconv.Itoa(r.port) }
func (r *lfRedis) url() string  { return "redis://" + r.addr() + "/0" }

// start starts a fresh (empty) redis-server on r.port and waits until it
// answers PING.
func (r *lfRedis) start() {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.Nil(r.t, r.cmd, "redis-server already running")
	cmd := exec.Command("redis-server", "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1",
		"--dir", r.dir, "--save", "", "--appendonly", "no", "--loglevel", "warning")
	require.NoError(r.t, cmd.Start(), "these tests need redis-server on PATH")
	r.cmd = cmd
	c := redis.NewClient(&redis.Options{Addr: r.addr(), DialTimeout: 100 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	harness.Eventually(r.t, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		return c.Ping(ctx).Err() == nil
	}, 10*time.Second, 5*time.Millisecond, "redis-server on %s never answered", r.addr())
}

// kill SIGKILLs the process and returns once it is reaped (its sockets are
// closed): the time the store went away.
func (r *lfRedis) kill() time.Time {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NotNil(r.t, r.cmd)
	require.NoError(r.t, r.cmd.Process.Signal(syscall.SIGKILL))
	_ = r.cmd.Wait()
	r.cmd = nil
	return time.Now()
}

// stop SIGSTOPs the process and returns once the kernel reports it stopped:
// from then on connections are accepted (by the kernel) but nothing is
// answered.
func (r *lfRedis) stop() time.Time {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NotNil(r.t, r.cmd)
	pid := r.cmd.Process.Pid
	require.NoError(r.t, r.cmd.Process.Signal(syscall.SIGSTOP))
	harness.Eventually(r.t, func() bool { return lfProcState(pid) == "T" }, 5*time.Second, time.Millisecond)
	return time.Now()
}

// cont resumes a stopped process.
func (r *lfRedis) cont() {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	require.NoError(r.t, r.cmd.Process.Signal(syscall.SIGCONT))
}

// client returns an inspection client of the current process.
func (r *lfRedis) client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: r.addr(), DialTimeout: time.Second, MaxRetries: 3})
	r.t.Cleanup(func() { _ = c.Close() })
	return c
}

var lfQuiet sync.Once

// lfQuietRedisLog silences go-redis's own log (a line per failed dial while
// a test holds Redis down) unless SLUICE_TEST_LOG is set. It is process
// wide, and harmless to the other tests.
func lfQuietRedisLog() {
	if os.Getenv("SLUICE_TEST_LOG") != "" {
		return
	}
	lfQuiet.Do(func() { redis.SetLogger(lfNoLog{}) })
}

type lfNoLog struct{}

func (lfNoLog) Printf(context.Context, string, ...any) {}

// lfProcState returns the state letter of /proc/<pid>/stat ("T" = stopped).
func lfProcState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 || i+2 >= len(s) {
		return ""
	}
	return s[i+2 : i+3]
}

// Usage the fake upstream reports for every request, so that every
// request of a test costs the same.
const (
	lfPromptTokens     = 10
	lfCompletionTokens = 8
	lfChunkEvery       = 50 * time.Millisecond
)

// lfClass counts what the upstream received of one class of requests.
type lfClass struct {
	inFlight atomic.Int64
	peak     atomic.Int64
	total    atomic.Int64
	mu       sync.Mutex
	arrivals map[string]time.Time // request tag → arrival
	leaves   map[string]time.Time // request tag → when it stopped counting as in flight
}

// span returns when the class request tagged id arrived and when it
// stopped counting as in flight (ok false: unknown or still in flight).
// The proxy held the request's slot over at least that span.
func (c *lfClass) span(id string) (arrived, left time.Time, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	arrived, ok1 := c.arrivals[id]
	left, ok2 := c.leaves[id]
	return arrived, left, ok1 && ok2
}

// lfUpstream is a fake OpenAI upstream. The user message of a request is
// "lf|<class>|<id>|<duration ms>": it answers after (or streams SSE chunks
// every lfChunkEvery for) that duration, and counts the requests of each
// class in flight, their peak and their arrivals. A request stops counting
// as in flight just before its final event is written, so the count never
// includes a request whose client (and proxy) may already have finished:
// it is a lower bound of the slots held.
type lfUpstream struct {
	srv     *httptest.Server
	mu      sync.Mutex
	classes map[string]*lfClass
}

func lfStartUpstream(t testing.TB) *lfUpstream {
	u := &lfUpstream{classes: map[string]*lfClass{}}
	u.srv = httptest.NewServer(u)
	t.Cleanup(u.srv.Close)
	return u
}

func (u *lfUpstream) class(name string) *lfClass {
	u.mu.Lock()
	defer u.mu.Unlock()
	c := u.classes[name]
	if c == nil {
		c = &lfClass{arrivals: map[string]time.Time{}, leaves: map[string]time.Time{}}
		u.classes[name] = c
	}
	return c
}

// arrivalsBetween returns the tags of class requests that arrived in [from, to).
func (c *lfClass) arrivalsBetween(from, to time.Time) map[string]time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string]time.Time{}
	for id, at := range c.arrivals {
		if !at.Before(from) && at.Before(to) {
			out[id] = at
		}
	}
	return out
}

func (u *lfUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Stream   bool `json:"stream"`
		Messages []struct {
			Content string `json:"content"`
		} `json:"messages"`
	}
	_ = json.Unmarshal(body, &req)
	var tag []string
	if len(req.Messages) > 0 {
		tag = strings.Split(req.Messages[0].Content, "|")
	}
	if len(tag) != 4 || tag[0] != "lf" {
		http.Error(w, `{"error":{"message":"not an lf request"}}`, http.StatusBadRequest)
		return
	}
	ms, _ := strconv.Atoi(tag[3])
	dur := time.Duration(ms) * time.Millisecond
	c := u.class(tag[1])
	c.mu.Lock()
	c.arrivals[tag[2]] = arrived
	c.mu.Unlock()
	c.total.Add(1)
	cur := c.inFlight.Add(1)
	for p := c.peak.Load(); cur > p && !c.peak.CompareAndSwap(p, cur); p = c.peak.Load() {
	}
	var left atomic.Bool
	leave := func() {
		if left.CompareAndSwap(false, true) {
			c.mu.Lock()
			c.leaves[tag[2]] = time.Now()
			c.mu.Unlock()
			c.inFlight.Add(-1)
		}
	}
	defer leave()
	usage := fmt.Sprintf(`"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`,
		lfPromptTokens, lfCompletionTokens, lfPromptTokens+lfCompletionTokens)
	end := arrived.Add(dur)
	if !req.Stream {
		select {
		case <-time.After(time.Until(end)):
		case <-r.Context().Done():
			return
		}
		leave()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],%s}`, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	for i := 0; ; i++ {
		fmt.Fprintf(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
		fl.Flush()
		wait := min(lfChunkEvery, time.Until(end))
		if wait <= 0 {
			break
		}
		select {
		case <-time.After(wait):
		case <-r.Context().Done():
			return
		}
	}
	leave()
	fmt.Fprintf(w, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"choices\":[],%s}\n\n", usage)
	fmt.Fprint(w, "data: [DONE]\n\n")
	fl.Flush()
}

// lfRes is one request as the client saw it.
type lfRes struct {
	class, id string
	proxy     int
	start     time.Time // before the request was sent
	hdr       time.Time // response headers received
	done      time.Time // body read
	status    int
	code      string
	limitType string
	retry     time.Duration // Retry-After-Ms
	err       error
}

func (r lfRes) latency() time.Duration { return r.done.Sub(r.start) }

// lfClient sends tagged requests and keeps every result.
type lfClient struct {
	hc  *http.Client
	seq atomic.Int64
	mu  sync.Mutex
	all []lfRes
}

func lfNewClient(t testing.TB) *lfClient {
	tr := &http.Transport{MaxIdleConns: 256, MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second}
	t.Cleanup(tr.CloseIdleConnections)
	return &lfClient{hc: &http.Client{Transport: tr}}
}

// do sends one chat request of class (streamed or not) that the upstream
// answers after dur, reads the whole answer and records it.
func (c *lfClient) do(ctx context.Context, proxyURL string, proxyIdx int, tok, class string, dur time.Duration, stream bool) lfRes {
	id := class + "-" + strconv.FormatInt(c.seq.Add(1), 10)
	body := fmt.Sprintf(`{"model":"lf","stream":%t,"max_tokens":32,"messages":[{"role":"user","content":"lf|%s|%s|%d"}]}`,
		stream, class, id, dur.Milliseconds())
	res := lfRes{class: class, id: id, proxy: proxyIdx}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	res.start = time.Now()
	resp, err := c.hc.Do(req)
	res.hdr = time.Now()
	if err != nil {
		res.err, res.done = err, res.hdr
		c.record(res)
		return res
	}
	res.status = resp.StatusCode
	res.limitType = resp.Header.Get("X-Sluice-Limit-Type")
	if ms, err := strconv.ParseInt(resp.Header.Get("Retry-After-Ms"), 10, 64); err == nil {
		res.retry = time.Duration(ms) * time.Millisecond
	}
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	res.done = time.Now()
	if err != nil && ctx.Err() == nil {
		res.err = err
	}
	if res.status != http.StatusOK {
		var e struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		_ = json.Unmarshal(b, &e)
		res.code = e.Error.Code
	} else if stream && !bytes.Contains(b, []byte("[DONE]")) && res.err == nil && ctx.Err() == nil {
		res.err = fmt.Errorf("stream ended without [DONE]")
	}
	c.record(res)
	return res
}

func (c *lfClient) record(r lfRes) {
	c.mu.Lock()
	c.all = append(c.all, r)
	c.mu.Unlock()
}

func (c *lfClient) results() []lfRes {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.all)
}

// first200After returns the earliest response headers of a 200 to a
// request of class sent at or after t.
func (c *lfClient) first200After(class string, t time.Time) (time.Time, bool) {
	var best time.Time
	for _, r := range c.results() {
		if r.class == class && r.status == http.StatusOK && !r.start.Before(t) && (best.IsZero() || r.hdr.Before(best)) {
			best = r.hdr
		}
	}
	return best, !best.IsZero()
}

// lfPause sleeps after a result as a polite client does: not after a 200,
// else the server's Retry-After-Ms bounded by upTo, at least floor, plus
// a little jitter.
func lfPause(ctx context.Context, r lfRes, floor, upTo time.Duration) {
	if r.status == http.StatusOK && r.err == nil {
		return
	}
	d := max(min(r.retry, upTo), floor) + time.Duration(rand.Int64N(int64(5*time.Millisecond)))
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// lfWorkers runs n goroutines calling one(ctx, worker) until ctx ends and
// returns a function that waits for them. one should not cancel a request
// when ctx ends: a load stops by letting every request finish, so that no
// client cancellation skews what the upstream and the counters saw.
func lfWorkers(ctx context.Context, n int, one func(ctx context.Context, w int)) (wait func()) {
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				one(ctx, w)
			}
		})
	}
	return wg.Wait
}

// lfP returns the nearest-rank p-th percentile of the latencies of rs.
func lfP(rs []lfRes, p int) time.Duration {
	d := make([]time.Duration, len(rs))
	for i, r := range rs {
		d[i] = r.latency()
	}
	return harness.Percentile(d, float64(p))
}

// lfModel creates model group "lf" with one priced deployment on up.
func lfModel(t testing.TB, d *dist, up *lfUpstream, prices *adminv1.Prices) {
	t.Helper()
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "lf", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: "lf", ApiBase: up.srv.URL + "/v1", UpstreamModel: "lf-upstream", Weight: 1, Prices: prices}))
	require.NoError(t, err)
}

// lfOrg creates an org and returns its id.
func lfOrg(t testing.TB, d *dist, name string) string {
	t.Helper()
	o, err := d.Clients().Org.CreateOrg(context.Background(), connect.NewRequest(&adminv1.CreateOrgRequest{Name: name}))
	require.NoError(t, err)
	return o.Msg.Org.Id
}

// lfTeam creates a team of org with limits (nil for none).
func lfTeam(t testing.TB, d *dist, org, name string, l *adminv1.Limits) string {
	t.Helper()
	tm, err := d.Clients().Team.CreateTeam(context.Background(), connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org, Name: name, Limits: l}))
	require.NoError(t, err)
	return tm.Msg.Team.Id
}

// lfKey creates a key of team with limits (nil for none) and returns its
// id and token.
func lfKey(t testing.TB, d *dist, org, team string, l *adminv1.Limits) (id, tok string) {
	t.Helper()
	k, err := d.Clients().Key.CreateKey(context.Background(), connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: org, TeamId: team, Limits: l}))
	require.NoError(t, err)
	return k.Msg.Key.Id, k.Msg.Token
}

// lfWaitAdmitted polls every proxy with short requests of tok until each
// admits one (the catalog caught up and, for an org whose limits state is
// new, the quarantine passed).
func lfWaitAdmitted(t testing.TB, c *lfClient, proxies []*proxy, tok, class string) {
	t.Helper()
	for i, p := range proxies {
		var last lfRes
		ok := harness.Until(func() bool {
			last = c.do(context.Background(), p.URL, i, tok, class, 0, false)
			return last.status == http.StatusOK
		}, 20*time.Second, 50*time.Millisecond)

		require.True(t, ok, "proxy %d never admitted %s: last %d %s %v", i, class, last.status, last.code, last.err)
	}
}

// lfLogBuf is a goroutine-safe buffer for a subprocess's output.
type lfLogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lfLogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lfLogBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// lfBuildSluice builds the real sluice binary from the module root.
func lfBuildSluice(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	require.NoError(t, err)
	root := strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
	bin := filepath.Join(t.TempDir(), "sluice")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/sluice")
	cmd.Dir = root
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build ./cmd/sluice: %s", b)
	return bin
}

// lfEnv is the environment of a subprocess: this one's without SLUICE_*
// variables, plus extra.
func lfEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SLUICE_") {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}
