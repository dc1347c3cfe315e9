package system

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
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
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// The overhead benchmark (issue 4): one zero-latency upstream (an
// in-process handler answering a fixed chat completion or a fixed SSE
// stream), reached three ways in the same run — directly, through a
// minimal httputil.ReverseProxy, and through a real Sluice data plane
// (config from the control plane over NATS, key auth, routing, usage
// events published to JetStream, metrics).
//
// What runs where (docs/proxy.md): the benchmark process holds the load
// client, the upstream, the ReverseProxy and the Sluice data plane. NATS
// (JetStream, fsync per write) runs as its own process (benchnats, built
// from this module by the benchmark), and so does the control plane (the
// `sluice control` binary, built by the benchmark: admin API, config
// publisher, usage consumer writing spend to Postgres); Postgres is the
// machine's server. They run during the measurements (usage events flow
// and are consumed while Sluice is measured; before each phase the
// benchmark waits for the ledger to catch up with the previous one), and
// their CPU is measured
// from /proc and reported separately. At the end every usage event of the
// run must be in spend_logs.
//
//	make bench-proxy
//	go test -run '^$' -bench BenchmarkProxyOverhead -benchtime 1x ./dataplane/
//
// SLUICE_BENCH_ROUNDS=n measures every path n times, interleaved, and
// reports the median of each figure.

const (
	benchChatBody = `{"model":"bench","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],` +
		`"max_tokens":128,"temperature":0.7}`
	benchCompletion = `{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench-upstream",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"A lighthouse keeper guards a remote coast and ` +
		`slowly learns that the light matters less than the people it brings home. In the end he leaves the tower ` +
		`to one of them."},"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":38,"total_tokens":80}}`
	// The same exchange in Anthropic Messages (docs/protocols.md): the same
	// prompt and answer, the same token counts.
	benchMessagesBody = `{"model":"bench","system":"You are a helpful assistant.","messages":[` +
		`{"role":"user","content":"Summarise the plot of a short novel about a lighthouse keeper in two sentences."}],` +
		`"max_tokens":128,"temperature":0.7}`
	benchMessage = `{"id":"msg_bench","type":"message","role":"assistant","model":"bench-upstream",` +
		`"content":[{"type":"text","text":"A lighthouse keeper guards a remote coast and ` +
		`slowly learns that the light matters less than the people it brings home. In the end he leaves the tower ` +
		`to one of them."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":42,"output_tokens":38}}`
	benchStreamChunks = 32
	benchSeq          = 2000            // requests per path at concurrency 1
	benchLoad         = 3 * time.Second // duration per path at concurrency 64
	benchConcurrency  = 64
	benchStreamSeq    = 300  // streams per path for time to first chunk
	benchPairSeq      = 3000 // rotations of the paired phase (one request per path each)
	benchChunkGap     = time.Millisecond
)

// benchUpstream answers every chat request at once: a fixed completion,
// or for "stream":true a fixed SSE stream whose chunks carry their send
// time (unix ns) so the client can measure each chunk's relay delay. With
// gap > 0 it waits that long between chunks.
func benchUpstream(gap time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var buf [4096]byte
		n, _ := r.Body.Read(buf[:])
		for n < len(buf) {
			m, err := r.Body.Read(buf[n:])
			n += m
			if err != nil {
				break
			}
		}
		if strings.HasSuffix(r.URL.Path, "/messages") {
			benchMessages(w, strings.Contains(string(buf[:n]), `"stream":true`), gap)
			return
		}
		if !strings.Contains(string(buf[:n]), `"stream":true`) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(len(benchCompletion)))
			_, _ = w.Write([]byte(benchCompletion))
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := range benchStreamChunks {
			if i > 0 && gap > 0 {
				time.Sleep(gap)
			}
			fmt.Fprintf(w, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"tok%d "},"finish_reason":null}],"sent":%d}`+"\n\n",
				i, time.Now().UnixNano())
			fl.Flush()
		}
		fmt.Fprintf(w, `data: {"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":42,"completion_tokens":%d,"total_tokens":%d}}`+"\n\ndata: [DONE]\n\n",
			benchStreamChunks, 42+benchStreamChunks)
		fl.Flush()
	})
}

// benchMessages answers an Anthropic Messages request: benchMessage, or
// a stream of Anthropic's events whose text deltas carry their send time
// like the chat chunks (usage in message_start and message_delta).
func benchMessages(w http.ResponseWriter, stream bool, gap time.Duration) {
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(benchMessage)))
		_, _ = w.Write([]byte(benchMessage))
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	fmt.Fprint(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_bench\",\"type\":\"message\",\"role\":\"assistant\","+
		"\"model\":\"m\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":42,\"output_tokens\":1}}}\n\n"+
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	fl.Flush()
	for i := range benchStreamChunks {
		if i > 0 && gap > 0 {
			time.Sleep(gap)
		}
		fmt.Fprintf(w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok%d \"},\"sent\":%d}\n\n",
			i, time.Now().UnixNano())
		fl.Flush()
	}
	fmt.Fprintf(w, "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"+
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":%d}}\n\n"+
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", benchStreamChunks)
	fl.Flush()
}

type benchPath struct {
	name string
	url  string // chat completions (or messages) URL
	tok  string
	body string // request body; empty: benchChatBody
}

// protocolHeaders adds what an Anthropic client sends on a Messages path.
func (p benchPath) protocolHeaders(req *http.Request) {
	if strings.HasSuffix(p.url, "/v1/messages") {
		req.Header.Set("Anthropic-Version", "2023-06-01")
	}
}

// reqBody is the path's request body.
func (p benchPath) reqBody() string {
	if p.body == "" {
		return benchChatBody
	}
	return p.body
}

func benchClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConns: 512, MaxIdleConnsPerHost: 512, DisableCompression: true}}
}

func doChat(c *http.Client, p benchPath, body string) error {
	req, _ := http.NewRequest(http.MethodPost, p.url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	p.protocolHeaders(req)
	if p.tok != "" {
		req.Header.Set("Authorization", "Bearer "+p.tok)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var sink [8192]byte
	for {
		if _, err := resp.Body.Read(sink[:]); err != nil {
			break
		}
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: status %d", p.name, resp.StatusCode)
	}
	return nil
}

// stream reads one stream and returns the time to its first chunk and
// the mean relay delay of its chunks (arrival − upstream send time).
func doStream(c *http.Client, p benchPath) (ttfc, meanDelay time.Duration, err error) {
	body := strings.Replace(p.reqBody(), `"max_tokens":128`, `"max_tokens":128,"stream":true`, 1)
	start := time.Now()
	req, _ := http.NewRequest(http.MethodPost, p.url, strings.NewReader(body))
	p.protocolHeaders(req)
	if p.tok != "" {
		req.Header.Set("Authorization", "Bearer "+p.tok)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	st, err := harness.ReadSSETiming(resp.Body, start)
	if st.Chunks != benchStreamChunks {
		return 0, 0, fmt.Errorf("%s: %d chunks, want %d", p.name, st.Chunks, benchStreamChunks)
	}
	return st.TTFT, st.MeanDelay, err
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

type benchResult struct {
	p50, p99  time.Duration
	rps       float64
	cpuPerReq time.Duration
	// infraPerReq is the CPU of the out-of-process infrastructure (NATS,
	// control plane, Postgres) per request at concurrency 64.
	infraPerReq   infraCPU
	requests      int64 // requests sent (each is one usage event on Sluice)
	ttfc50        time.Duration
	chunkDelay    time.Duration
	streamTTFCp99 time.Duration
	streamsCut    int
}

func measure(tb testing.TB, p benchPath, infra func() infraCPU, settle func()) benchResult {
	var r benchResult
	infra() // also lowers the priority of new Postgres backends
	settle()
	c := benchClient()
	for range 200 { // warm connections and caches
		require.NoError(tb, doChat(c, p, p.reqBody()))
	}
	lat := make([]time.Duration, 0, benchSeq)
	for range benchSeq {
		t0 := time.Now()
		require.NoError(tb, doChat(c, p, p.reqBody()))
		lat = append(lat, time.Since(t0))
	}
	r.p50, r.p99 = harness.Percentile(lat, 50), harness.Percentile(lat, 99)
	settle()

	var done atomic.Int64
	var failed atomic.Value
	ctx, cancel := context.WithTimeout(context.Background(), benchLoad)
	infra0 := infra()
	cpu0, t0 := cpuTime(), time.Now()
	var wg sync.WaitGroup
	for range benchConcurrency {
		wg.Go(func() {
			for ctx.Err() == nil {
				if err := doChat(c, p, p.reqBody()); err != nil {
					failed.Store(err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	cancel()
	elapsed, cpu := time.Since(t0), cpuTime()-cpu0
	r.infraPerReq = infra().sub(infra0).div(done.Load())
	if err, _ := failed.Load().(error); err != nil {
		tb.Fatal(err)
	}
	r.rps = float64(done.Load()) / elapsed.Seconds()
	r.cpuPerReq = cpu / time.Duration(done.Load())

	settle()
	ttfcs := make([]time.Duration, 0, benchStreamSeq)
	var delays time.Duration
	for range benchStreamSeq {
		ttfc, d, err := doStream(c, p)
		for try := 0; err != nil && try < 3; try++ {
			// httputil.ReverseProxy cuts a few percent of streams on this
			// loopback setup (its inbound context ends mid-stream); such a
			// stream is counted and measured again. Sluice must cut none.
			r.streamsCut++
			ttfc, d, err = doStream(c, p)
		}
		require.NoError(tb, err)
		ttfcs = append(ttfcs, ttfc)
		delays += d
	}
	r.requests = 200 + benchSeq + done.Load() + benchStreamSeq + int64(r.streamsCut)
	r.ttfc50, r.streamTTFCp99 = harness.Percentile(ttfcs, 50), harness.Percentile(ttfcs, 99)
	r.chunkDelay = delays / benchStreamSeq
	return r
}

// infraCPU is CPU time of the processes outside the benchmark.
type infraCPU struct{ nats, control, postgres time.Duration }

func (a infraCPU) sub(b infraCPU) infraCPU {
	return infraCPU{a.nats - b.nats, a.control - b.control, a.postgres - b.postgres}
}

func (a infraCPU) div(n int64) infraCPU {
	if n == 0 {
		return infraCPU{}
	}
	d := time.Duration(n)
	return infraCPU{a.nats / d, a.control / d, a.postgres / d}
}

// procCPU returns the user+system CPU of a process from /proc (clock
// ticks of 10 ms, Linux's USER_HZ), 0 if it is gone.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // fields from 3 (state) on
	ut, _ := strconv.ParseInt(f[11], 10, 64)                 // field 14 utime
	st, _ := strconv.ParseInt(f[12], 10, 64)                 // field 15 stime
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// postgresCPU sums the CPU of every postgres process on the machine (the
// server and its backends; backends that exit meanwhile are missed, so it
// is a lower bound).
func postgresCPU() time.Duration {
	ents, _ := os.ReadDir("/proc")
	var total time.Duration
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && strings.TrimSpace(string(comm)) == "postgres" {
			total += procCPU(pid)
		}
	}
	return total
}

// goBuild builds a package of this module into dir and returns the binary.
func goBuild(tb testing.TB, dir, pkg, name string) string {
	tb.Helper()
	goBin := filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		goBin = "go"
	}
	out := filepath.Join(dir, name)
	cmd := exec.Command(goBin, "build", "-o", out, pkg)
	cmd.Dir = "../.." // the module root (tests run in ./e2e/system)
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	return out
}

func freePort(tb testing.TB) int {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// infraNice is the nice value of the infrastructure processes: they
// stand for servers that run on other machines in production, so they
// yield the CPU to the benchmark process and catch up when it idles
// (their CPU is reported separately). SLUICE_BENCH_INFRA_NICE=0 runs them
// at normal priority.
func infraNice() int {
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_INFRA_NICE")); err == nil && v >= 0 && v <= 19 {
		return v
	}
	return 19
}

// infraCommand is exec.Command at the infrastructure's nice value.
func infraCommand(name string, args ...string) *exec.Cmd {
	if n := infraNice(); n > 0 {
		return exec.Command("nice", append([]string{"-n", strconv.Itoa(n), name}, args...)...)
	}
	return exec.Command(name, args...)
}

// startProc starts a helper process that stops when the benchmark ends
// (SIGTERM, then SIGKILL after 10 s).
func startProc(tb testing.TB, cmd *exec.Cmd) *exec.Cmd {
	tb.Helper()
	cmd.Stderr = os.Stderr
	require.NoError(tb, cmd.Start())
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return cmd
}

// startBenchInfra starts NATS and the control plane as their own
// processes on a fresh database and returns the harness handle for them
// and a function reading their CPU.
// benchSluiceBin is the sluice binary startBenchInfra built (for a
// benchmark that runs a data plane of its own as `sluice proxy`).
var benchSluiceBin string

func startBenchInfra(tb testing.TB) (*dist, func() infraCPU) {
	tb.Helper()
	bin := tb.TempDir()
	natsBin := goBuild(tb, bin, "./dataplane/internal/benchnats", "benchnats")
	sluiceBin := goBuild(tb, bin, "./cmd/sluice", "sluice")
	benchSluiceBin = sluiceBin

	port := freePort(tb)
	natsArgs := []string{"-port", strconv.Itoa(port), "-store", tb.TempDir(), "-sync-always"}
	if a := os.Getenv("SLUICE_BENCH_NATS_PPROF"); a != "" {
		natsArgs = append(natsArgs, "-pprof-addr", a) // to profile NATS during a benchmark
	}
	nc := infraCommand(natsBin, natsArgs...)
	stdin, err := nc.StdinPipe() // closed at exit: the helper never outlives the benchmark
	require.NoError(tb, err)
	stdout, err := nc.StdoutPipe()
	require.NoError(tb, err)
	startProc(tb, nc)
	tb.Cleanup(func() { _ = stdin.Close() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(tb, err, "benchnats did not start")
	require.Equal(tb, "ready\n", line)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", port)

	dbURL := testsvc.NewDatabase(tb)
	adminAddr := fmt.Sprintf("127.0.0.1:%d", freePort(tb))
	cp := infraCommand(sluiceBin, "control", "--addr", adminAddr, "--database-url", dbURL, "--nats-url", natsURL,
		"--instance-id", "bench-cp", "--log-level", "warn")
	if a := os.Getenv("SLUICE_BENCH_CONTROL_PPROF"); a != "" {
		cp.Args = append(cp.Args, "--pprof-addr", a) // to profile the control plane during a benchmark
	}
	cp.Env = append(os.Environ(), "SLUICE_ADMIN_TOKEN="+testBootstrap, "SLUICE_KEY_PEPPER="+testPepper, "SLUICE_KEK="+testKEK)
	startProc(tb, cp)
	admin := "http://" + adminAddr
	harness.Eventually(tb, func() bool {
		resp, err := http.Get(admin + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 50*time.Millisecond, "control plane not ready")

	d := &dist{&harness.Dist{T: tb, NATS: &testsvc.NATSServer{URL: natsURL}, DatabaseURL: dbURL, Admin: admin}}
	pg, err := pgx.Connect(context.Background(), dbURL)
	require.NoError(tb, err)
	tb.Cleanup(func() { _ = pg.Close(context.Background()) })
	return d, func() infraCPU {
		// The Postgres backends serving the control plane (on this
		// benchmark's database only) are infrastructure too.
		if n := infraNice(); n > 0 {
			rows, err := pg.Query(context.Background(),
				`SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`)
			require.NoError(tb, err)
			pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
			require.NoError(tb, err)
			for _, pid := range pids {
				_ = syscall.Setpriority(syscall.PRIO_PROCESS, int(pid), n)
			}
		}
		return infraCPU{nats: procCPU(nc.Process.Pid), control: procCPU(cp.Process.Pid), postgres: postgresCPU()}
	}
}

func median(rs []benchResult, f func(benchResult) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	return v[len(v)/2]
}

func BenchmarkProxyOverhead(b *testing.B) {
	d, infra := startBenchInfra(b)
	ctx := context.Background()
	up := httptest.NewServer(benchUpstream(benchChunkGap))
	b.Cleanup(up.Close)

	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "bench", PlatformWide: true}))
	require.NoError(b, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "bench",
		ApiBase: up.URL + "/v1", UpstreamModel: "bench-upstream", Weight: 1,
		Capabilities: &adminv1.Capabilities{Protocols: []string{"anthropic_messages"}},
		Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}}))
	require.NoError(b, err)
	ten := d.NewTenant("bench")
	p := d.StartProxy("default", time.Minute)
	harness.Eventually(b, func() bool { return len(p.DP.Catalog().Deployments("bench")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(b, p, ten.Token, http.StatusOK, 10*time.Second)

	target, _ := url.Parse(up.URL)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 256, DisableCompression: true}
	rp.FlushInterval = -1
	rps := httptest.NewServer(rp)
	b.Cleanup(rps.Close)

	paths := []benchPath{
		{name: "direct", url: up.URL + "/v1/chat/completions"},
		{name: "reverseproxy", url: rps.URL + "/v1/chat/completions"},
		{name: "sluice", url: p.URL + "/v1/chat/completions", tok: ten.Token},
		// The same exchange over Anthropic Messages (issue 16): its
		// overhead is compared with chat's in the same run.
		{name: "direct-messages", url: up.URL + "/v1/messages", body: benchMessagesBody},
		{name: "sluice-messages", url: p.URL + "/v1/messages", tok: ten.Token, body: benchMessagesBody},
	}
	rounds := 1
	if v, err := strconv.Atoi(os.Getenv("SLUICE_BENCH_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	all := map[string][]benchResult{}
	// settle waits, before each phase, until the ledger has caught up with
	// the previous one (publisher buffer and spool empty, spend_logs no
	// longer growing), so a phase is not measured against the backlog of
	// the one before it.
	pg, err := pgx.Connect(ctx, d.DatabaseURL)
	require.NoError(b, err)
	defer pg.Close(ctx)
	settle := func() {
		deadline := time.Now().Add(time.Minute)
		last := int64(-1)
		for time.Now().Before(deadline) {
			var n int64
			require.NoError(b, pg.QueryRow(ctx, `SELECT count(*) FROM spend_logs`).Scan(&n))
			st := p.DP.UsageStats()
			if st.Buffered == 0 && st.SpoolBytes == 0 && n == last {
				return
			}
			last = n
			time.Sleep(200 * time.Millisecond)
		}
	}
	var sluiceRequests int64
	for range b.N {
		for range rounds {
			for _, path := range paths {
				r := measure(b, path, infra, settle)
				all[path.name] = append(all[path.name], r)
				if path.tok != "" { // through Sluice: one usage event each
					sluiceRequests += r.requests
				}
			}
		}
	}

	// Paired phase: the chat and Messages paths, direct and through
	// Sluice, request by request in rotating order at concurrency 1, so
	// that the load of a shared machine falls on all four alike; the
	// added p50s compared here come from one stretch of time, not from
	// phases minutes apart.
	settle()
	pair := []benchPath{paths[0], paths[2], paths[3], paths[4]}
	pairLat := make([][]time.Duration, len(pair))
	pairClients := make([]*http.Client, len(pair))
	for i, pp := range pair {
		pairClients[i] = benchClient()
		for range 100 {
			require.NoError(b, doChat(pairClients[i], pp, pp.reqBody()))
		}
	}
	for n := range benchPairSeq {
		for k := range pair {
			i := (n + k) % len(pair)
			t0 := time.Now()
			require.NoError(b, doChat(pairClients[i], pair[i], pair[i].reqBody()))
			pairLat[i] = append(pairLat[i], time.Since(t0))
		}
	}
	sluiceRequests += 2 * (100 + benchPairSeq)
	pairP50 := make([]time.Duration, len(pair))
	for i := range pair {
		pairP50[i] = harness.Percentile(pairLat[i], 50)
	}
	pairedRatio := float64(pairP50[3]-pairP50[2]) / float64(pairP50[1]-pairP50[0])

	// Every usage event of the run reaches spend_logs (the consumer ran
	// throughout; this waits for its backlog, outside the measurements).
	lagStart := time.Now()
	var rows int64
	harness.Eventually(b, func() bool {
		require.NoError(b, pg.QueryRow(ctx, `SELECT count(*) FROM spend_logs WHERE key_id = $1`, ten.KeyID).Scan(&rows))
		return rows >= sluiceRequests
	}, 2*time.Minute, 100*time.Millisecond, "spend_logs has %d of %d usage events", rows, sluiceRequests)
	require.Equal(b, sluiceRequests, rows, "spend_logs rows")
	backlog := time.Since(lagStart)

	med := func(name string, f func(benchResult) float64) float64 { return median(all[name], f) }
	dur := func(f func(benchResult) time.Duration) func(benchResult) float64 {
		return func(r benchResult) float64 { return float64(f(r)) }
	}
	fig := func(name string) benchResult {
		return benchResult{
			p50:        time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.p50 }))),
			p99:        time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.p99 }))),
			rps:        med(name, func(r benchResult) float64 { return r.rps }),
			cpuPerReq:  time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.cpuPerReq }))),
			ttfc50:     time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.ttfc50 }))),
			chunkDelay: time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.chunkDelay }))),
			infraPerReq: infraCPU{
				nats:     time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.infraPerReq.nats }))),
				control:  time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.infraPerReq.control }))),
				postgres: time.Duration(med(name, dur(func(r benchResult) time.Duration { return r.infraPerReq.postgres }))),
			},
		}
	}
	dir, rpr, sl := fig("direct"), fig("reverseproxy"), fig("sluice")
	dirMsg, slMsg := fig("direct-messages"), fig("sluice-messages")
	figs := map[string]benchResult{"direct": dir, "reverseproxy": rpr, "sluice": sl, "direct-messages": dirMsg, "sluice-messages": slMsg}
	base := map[string]benchResult{"direct": dir, "reverseproxy": dir, "sluice": dir, "direct-messages": dirMsg, "sluice-messages": dirMsg}
	cut := map[string]int{}
	for n, rs := range all {
		for _, r := range rs {
			cut[n] += r.streamsCut
		}
	}
	us := func(d time.Duration) string { return fmt.Sprintf("%.1fµs", float64(d)/float64(time.Microsecond)) }
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n%d round(s); medians over rounds; NATS and control plane at nice %d\n", rounds, infraNice())
	fmt.Fprintf(&sb, "| path | p50 (c=1) | p99 (c=1) | added p50 | added p99 | req/s (c=64) | CPU/req (bench process) | TTFC p50 | added TTFC p50 | chunk relay delay | NATS / control plane / Postgres CPU/req |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, n := range []string{"direct", "reverseproxy", "sluice", "direct-messages", "sluice-messages"} {
		r, d := figs[n], base[n] // added figures are against the direct path of the same protocol
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %.0f | %s | %s | %s | %s | %s / %s / %s |\n", n, us(r.p50), us(r.p99), us(r.p50-d.p50), us(r.p99-d.p99),
			r.rps, us(r.cpuPerReq), us(r.ttfc50), us(r.ttfc50-d.ttfc50), us(r.chunkDelay),
			us(r.infraPerReq.nats), us(r.infraPerReq.control), us(r.infraPerReq.postgres))
	}
	fmt.Fprintf(&sb, "sluice/reverseproxy: throughput %.2f× (target ≥ 0.9), added p50 %.2f× (target ≤ 1.2), added CPU/req %.2f×, added TTFC %.2f×, added chunk delay %s vs %s\n",
		sl.rps/rpr.rps, float64(sl.p50-dir.p50)/float64(rpr.p50-dir.p50),
		float64(sl.cpuPerReq-dir.cpuPerReq)/float64(rpr.cpuPerReq-dir.cpuPerReq),
		float64(sl.ttfc50-dir.ttfc50)/float64(rpr.ttfc50-dir.ttfc50),
		us(sl.chunkDelay-dir.chunkDelay), us(rpr.chunkDelay-dir.chunkDelay))
	msgAddedP50 := float64(slMsg.p50-dirMsg.p50) / float64(sl.p50-dir.p50)
	fmt.Fprintf(&sb, "sluice messages/chat: added p50 %.2f× (target ≤ 1.05), throughput %.2f× (target ≥ 0.95), added CPU/req %.2f×, added TTFC %.2f×, added chunk delay %s vs %s\n",
		msgAddedP50, slMsg.rps/sl.rps, float64(slMsg.cpuPerReq-dirMsg.cpuPerReq)/float64(sl.cpuPerReq-dir.cpuPerReq),
		float64(slMsg.ttfc50-dirMsg.ttfc50)/float64(sl.ttfc50-dir.ttfc50), us(slMsg.chunkDelay-dirMsg.chunkDelay), us(sl.chunkDelay-dir.chunkDelay))
	for i := range rounds * b.N {
		d, r, s := all["direct"][i], all["reverseproxy"][i], all["sluice"][i]
		dm, sm := all["direct-messages"][i], all["sluice-messages"][i]
		fmt.Fprintf(&sb, "round %d: added p50 reverseproxy %s sluice %s (%.2f×) messages %s (%.2f× chat); req/s reverseproxy %.0f sluice %.0f (%.2f×) messages %.0f (%.2f× chat)\n", i+1,
			us(r.p50-d.p50), us(s.p50-d.p50), float64(s.p50-d.p50)/float64(r.p50-d.p50), us(sm.p50-dm.p50), float64(sm.p50-dm.p50)/float64(s.p50-d.p50),
			r.rps, s.rps, s.rps/r.rps, sm.rps, sm.rps/s.rps)
	}
	fmt.Fprintf(&sb, "paired (%d rotations at c=1): p50 direct %s sluice %s direct-messages %s sluice-messages %s; added p50 chat %s messages %s: messages/chat %.2f× (target ≤ 1.05)\n",
		benchPairSeq, us(pairP50[0]), us(pairP50[1]), us(pairP50[2]), us(pairP50[3]), us(pairP50[1]-pairP50[0]), us(pairP50[3]-pairP50[2]), pairedRatio)
	fmt.Fprintf(&sb, "streams cut and repeated: direct %d, reverseproxy %d, sluice %d, direct-messages %d, sluice-messages %d (of %d each per round)\n",
		cut["direct"], cut["reverseproxy"], cut["sluice"], cut["direct-messages"], cut["sluice-messages"], benchStreamSeq)
	fmt.Fprintf(&sb, "ledger: %d usage events, all %d in spend_logs; consumer backlog drained %s after the last measurement\n",
		sluiceRequests, rows, backlog.Round(time.Millisecond))
	require.Zero(b, cut["sluice"], "Sluice cut a stream")
	require.Zero(b, cut["sluice-messages"], "Sluice cut a Messages stream")
	b.Log(sb.String())
	b.ReportMetric(sl.rps/rpr.rps, "throughput_ratio")
	b.ReportMetric(float64(sl.p50-dir.p50)/float64(rpr.p50-dir.p50), "added_p50_ratio")
	b.ReportMetric(float64(sl.p50-dir.p50)/float64(time.Microsecond), "sluice_added_p50_us")
	b.ReportMetric(float64(sl.p99-dir.p99)/float64(time.Microsecond), "sluice_added_p99_us")
	b.ReportMetric(float64(sl.chunkDelay-dir.chunkDelay)/float64(time.Microsecond), "sluice_added_chunk_delay_us")
	b.ReportMetric(msgAddedP50, "messages_added_p50_ratio")
	b.ReportMetric(pairedRatio, "messages_paired_added_p50_ratio")
	b.ReportMetric(slMsg.rps/sl.rps, "messages_throughput_ratio")
}
