package vllmsim

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// shutdownTimeout bounds how long Serve waits for handlers after its context
// is done (the engine has already failed every request by then).
const shutdownTimeout = 5 * time.Second

// Server is a simulated vLLM OpenAI-compatible server: the HTTP API in front
// of a simulated engine. Create it with New (or Start), serve it with Run,
// Serve or Handler plus RunEngine.
type Server struct {
	cfg     Config
	log     *slog.Logger
	eng     *engine
	handler http.Handler
	names   []string
	created int64

	ordinal atomic.Uint64 // requests seen, for per-request seeds and IDs
	faults  atomic.Pointer[Faults]
	// frozenMetrics is the /metrics page a MetricsFrozen fault serves.
	frozenMetrics atomic.Pointer[[]byte]
	prios         priorityLog // priorities requests arrived with

	rngMu sync.Mutex
	rng   *rand.Rand // fault draws

	lnMu  sync.Mutex
	ln    *switchListener // set while Serve runs
	conns map[net.Conn]struct{}
	timer *time.Timer // re-opens the listener after a refuse-for fault

	// responses are the stored Responses of /v1/responses (protocols.go).
	responses responseStore

	// set by Start
	stop context.CancelFunc
	done chan error
}

// New returns a server for cfg; it logs to logger. Nothing runs until Run,
// Serve or RunEngine is called.
func New(cfg Config, logger *slog.Logger) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("vllm-sim config: %w", err)
	}
	if logger == nil {
		return nil, errors.New("vllm-sim: nil logger")
	}
	eng, err := newEngine(cfg.EngineConfig, cfg.TimeScale, logger)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		log:     logger,
		eng:     eng,
		names:   cfg.servedNames(),
		created: time.Now().Unix(),
		rng:     rand.New(rand.NewPCG(cfg.Seed, 0x5eed)),
		conns:   make(map[net.Conn]struct{}),
	}
	f := cfg.Faults
	s.faults.Store(&f)
	s.handler = s.routes()
	return s, nil
}

// Config returns the server's configuration.
func (s *Server) Config() Config { return s.cfg }

// Handler returns the HTTP API. The engine must be running (Run, Serve or
// RunEngine) for requests to make progress.
func (s *Server) Handler() http.Handler { return s.handler }

// SetFaults replaces the fault injection applied to every request.
func (s *Server) SetFaults(f Faults) error {
	if err := f.Validate(); err != nil {
		return fmt.Errorf("faults: %w", err)
	}
	s.frozenMetrics.Store(nil)
	s.faults.Store(&f)
	return nil
}

// Stats returns a snapshot of the engine's metrics.
func (s *Server) Stats() Stats {
	st, _ := s.eng.stats()
	return st
}

// SimulatedTime returns the current simulated time: wall time since New,
// multiplied by the time scale.
func (s *Server) SimulatedTime() time.Duration { return s.eng.clock.now() }

// RunEngine drives the simulated engine until ctx is done. Run and Serve
// call it; call it directly only when serving Handler yourself.
func (s *Server) RunEngine(ctx context.Context) error { return s.eng.run(ctx) }

// Run listens on the configured address and serves until ctx is done.
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", s.cfg.Addr, err)
	}
	return s.Serve(ctx, ln)
}

// Serve runs the engine and serves the API on ln until ctx is done, then
// shuts down: the requests in flight fail and ln is closed.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	sl, err := s.bind(ln)
	if err != nil {
		return err
	}
	return s.serve(ctx, sl)
}

// bind makes ln the server's listener.
func (s *Server) bind(ln net.Listener) (*switchListener, error) {
	s.lnMu.Lock()
	defer s.lnMu.Unlock()
	if s.ln != nil {
		ln.Close()
		return nil, errors.New("vllm-sim: already serving")
	}
	s.ln = newSwitchListener(ln, s)
	return s.ln, nil
}

func (s *Server) serve(ctx context.Context, sl *switchListener) error {
	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ConnState:         s.trackConn,
	}
	engCtx, stopEngine := context.WithCancel(context.Background())
	engDone := make(chan error, 1)
	go func() { engDone <- s.eng.run(engCtx) }()
	srvDone := make(chan error, 1)
	go func() { srvDone <- hs.Serve(sl) }()
	s.log.Info("vllm-sim serving", slog.String("url", "http://"+sl.Addr().String()),
		slog.String("model", s.names[0]), slog.Int("max_num_seqs", s.cfg.MaxNumSeqs),
		slog.String("scheduling_policy", string(s.cfg.SchedulingPolicy)),
		slog.Float64("time_scale", s.cfg.TimeScale))

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-srvDone:
	}
	// Stop the engine first: it fails the requests in flight, so their
	// handlers return and the graceful shutdown does not wait for streams.
	stopEngine()
	engErr := <-engDone
	shutCtx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	shutErr := hs.Shutdown(shutCtx)
	if shutErr != nil {
		hs.Close()
	}
	sl.Close()
	if serveErr == nil {
		serveErr = <-srvDone
	}
	s.lnMu.Lock()
	s.ln = nil
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	s.lnMu.Unlock()
	s.log.Info("vllm-sim stopped")
	switch {
	case serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed):
		return fmt.Errorf("serve: %w", serveErr)
	case engErr != nil:
		return fmt.Errorf("engine: %w", engErr)
	case shutErr != nil:
		return fmt.Errorf("shutdown: %w", shutErr)
	}
	return nil
}

// Start creates a server for cfg, listens on cfg.Addr (use
// "127.0.0.1:0" for a free port) and serves in the background until Close.
// It returns once the listener is bound, so URL is usable at once.
func Start(cfg Config, logger *slog.Logger) (*Server, error) {
	s, err := New(cfg, logger)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", cfg.Addr, err)
	}
	sl, err := s.bind(ln)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.stop = cancel
	s.done = make(chan error, 1)
	go func() { s.done <- s.serve(ctx, sl) }()
	return s, nil
}

// Close stops a server created by Start and waits for it.
func (s *Server) Close() error {
	if s.stop == nil {
		return errors.New("vllm-sim: Close is only for servers created by Start")
	}
	s.stop()
	return <-s.done
}

// URL returns the server's base URL ("http://127.0.0.1:PORT"); OpenAI
// clients take URL()+"/v1". It is empty when the server is not serving.
func (s *Server) URL() string {
	s.lnMu.Lock()
	defer s.lnMu.Unlock()
	if s.ln == nil {
		return ""
	}
	return "http://" + s.ln.Addr().String()
}

// SetRefuseConnections makes the server behave like a dead engine (true):
// its listening socket is closed, so new connections are refused, and every
// open connection is dropped; false listens again on the same address.
func (s *Server) SetRefuseConnections(refuse bool) error {
	s.lnMu.Lock()
	defer s.lnMu.Unlock()
	if s.ln == nil {
		return errors.New("vllm-sim: not serving")
	}
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
	return s.setRefusingLocked(refuse)
}

func (s *Server) setRefusingLocked(refuse bool) error {
	if err := s.ln.setRefusing(refuse); err != nil {
		return err
	}
	if refuse {
		for c := range s.conns {
			c.Close()
		}
	}
	return nil
}

// refuseFor refuses connections for d of wall-clock time.
func (s *Server) refuseFor(d time.Duration) {
	s.lnMu.Lock()
	defer s.lnMu.Unlock()
	if s.ln == nil {
		return
	}
	if err := s.setRefusingLocked(true); err != nil {
		s.log.Warn("refuse connections", slog.Any("error", err))
		return
	}
	if s.timer != nil {
		s.timer.Stop()
	}
	s.timer = time.AfterFunc(d, func() {
		s.lnMu.Lock()
		defer s.lnMu.Unlock()
		s.timer = nil
		if s.ln == nil {
			return
		}
		if err := s.ln.setRefusing(false); err != nil {
			s.log.Warn("accept connections again", slog.Any("error", err))
		}
	})
}

func (s *Server) trackConn(c net.Conn, st http.ConnState) {
	s.lnMu.Lock()
	defer s.lnMu.Unlock()
	switch st {
	case http.StateNew:
		s.conns[c] = struct{}{}
	case http.StateClosed, http.StateHijacked:
		delete(s.conns, c)
	}
}

// chance draws from the server's seeded fault generator.
func (s *Server) chance(p float64) bool {
	if p <= 0 {
		return false
	}
	if p >= 1 {
		return true
	}
	s.rngMu.Lock()
	defer s.rngMu.Unlock()
	return s.rng.Float64() < p
}

// switchListener wraps a TCP listener so that it can stop listening (the
// port refuses connections) and listen again on the same address, and so
// that it can reset a fraction of accepted connections.
type switchListener struct {
	addr net.Addr
	srv  *Server

	mu      sync.Mutex
	cur     net.Listener // nil while refusing
	changed chan struct{}
	closed  bool
}

func newSwitchListener(ln net.Listener, srv *Server) *switchListener {
	return &switchListener{addr: ln.Addr(), srv: srv, cur: ln, changed: make(chan struct{})}
}

// Accept waits for the next connection that is not reset by fault injection.
func (l *switchListener) Accept() (net.Conn, error) {
	for {
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			return nil, net.ErrClosed
		}
		cur, changed := l.cur, l.changed
		l.mu.Unlock()
		if cur == nil {
			<-changed
			continue
		}
		c, err := cur.Accept()
		if err != nil {
			l.mu.Lock()
			swapped := l.closed || l.cur != cur
			l.mu.Unlock()
			if swapped {
				continue
			}
			return nil, err
		}
		if l.srv.chance(l.srv.faults.Load().ResetProbability) {
			if tc, ok := c.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // close with RST
			}
			c.Close()
			continue
		}
		return c, nil
	}
}

func (l *switchListener) setRefusing(refuse bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return net.ErrClosed
	}
	switch {
	case refuse && l.cur != nil:
		err := l.cur.Close()
		l.cur = nil
		close(l.changed)
		l.changed = make(chan struct{})
		return err
	case !refuse && l.cur == nil:
		ln, err := net.Listen(l.addr.Network(), l.addr.String())
		if err != nil {
			return fmt.Errorf("listen again on %s: %w", l.addr, err)
		}
		l.cur = ln
		close(l.changed)
		l.changed = make(chan struct{})
	}
	return nil
}

// Close stops listening for good.
func (l *switchListener) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	close(l.changed)
	if l.cur != nil {
		err := l.cur.Close()
		l.cur = nil
		return err
	}
	return nil
}

// Addr returns the listening address, also while refusing.
func (l *switchListener) Addr() net.Addr { return l.addr }

// bearerOK reports whether the Authorization header carries key.
func bearerOK(header, key string) bool {
	token, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(token), []byte(key)) == 1
}
