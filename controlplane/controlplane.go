// Package controlplane runs Sluice's control plane: the Postgres-backed
// owner of the tenancy hierarchy, virtual keys, admin tokens and audit
// trail, serving the Connect admin API (SPEC §2, §5).
//
// Config, New and Run are its whole exported surface; everything else is
// in internal packages.
package controlplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"golang.org/x/sync/errgroup"

	"github.com/sluicegw/sluice/controlplane/internal/admin"
	"github.com/sluicegw/sluice/controlplane/internal/alerts"
	"github.com/sluicegw/sluice/controlplane/internal/auditexport"
	"github.com/sluicegw/sluice/controlplane/internal/console"
	"github.com/sluicegw/sluice/controlplane/internal/publish"
	"github.com/sluicegw/sluice/controlplane/internal/seeds"
	"github.com/sluicegw/sluice/controlplane/internal/spend"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/sql/migrations"
)

// ControlPlane is a configured, not yet running control plane.
type ControlPlane struct {
	cfg    Config
	log    *slog.Logger
	pool   *pgxpool.Pool
	ln     net.Listener
	srv    *http.Server
	store  *store.Store
	nc     *nats.Conn
	pub    *publish.Publisher
	spend  *spend.Consumer
	alerts *alerts.Consumer
	// deliver sends budget alerts to the orgs' webhooks.
	deliver *alerts.Deliverer
	seeds   *seeds.Responder
	// auditExport publishes the audit log to SLUICE_AUDIT.
	auditExport *auditexport.Exporter
}

// New connects to Postgres, checks (or applies, with Migrate) the schema
// and binds the admin listener.
func New(ctx context.Context, cfg Config) (*ControlPlane, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	peppers, _ := token.ParsePeppers(cfg.KeyPepper)
	ring, _ := keyring.Parse(cfg.KEK)
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect postgres: %w", redactErr(err))
	}
	if pcfg.ConnConfig.ConnectTimeout == 0 {
		pcfg.ConnConfig.ConnectTimeout = DefaultDBConnectTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect postgres: %w", redactErr(err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect postgres: %w", err)
	}
	if cfg.Migrate {
		applied, err := migrations.Apply(ctx, pool)
		if err != nil {
			pool.Close()
			return nil, err
		}
		if len(applied) > 0 {
			log.Info("applied migrations", "versions", applied)
		}
	} else if err := migrations.CheckCurrent(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	if cfg.InstanceID == "" {
		host, _ := os.Hostname()
		cfg.InstanceID = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("sluice-control "+cfg.InstanceID), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	st := store.New(pool, cfg.Now)
	pub, err := publish.New(publish.Config{
		InstanceID: cfg.InstanceID, Debounce: cfg.Publish.Debounce, MaxDelay: cfg.Publish.MaxDelay, TickInterval: cfg.Publish.TickInterval, Logger: log,
		OnHeartbeat: func(ctx context.Context, hb *configv1.Heartbeat) error {
			return st.DataPlaneUpsert(ctx, dataPlaneFrom(hb))
		},
	}, st, pool, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// Every replica consumes usage events; JetStream spreads the batches
	// and recording is idempotent (see package spend).
	spendConsumer, err := spend.New(spend.Config{Logger: log}, st, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// Budget alerts the same way (see package alerts).
	alertConsumer, err := alerts.New(alerts.Config{Logger: log}, st, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// Every replica delivers alerts to webhooks from the outbox table.
	dcfg := alerts.DeliveryConfig{Logger: log}
	if ring != nil {
		dcfg.Open = ring.Open
	}
	deliverer := alerts.NewDeliverer(dcfg, st)
	// Every replica answers budget seed requests (queue group): the
	// ledger's current spend, once the spend consumer has caught up.
	seedResponder, err := seeds.New(seeds.Config{Durable: spend.DefaultDurable, Logger: log}, st, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// One replica exports the audit log to JetStream (see auditexport).
	auditExp, err := auditexport.New(auditexport.Config{Pool: pool, NC: nc, Retention: cfg.AuditRetention, Logger: log})
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.AdminAddr)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, fmt.Errorf("listen on %s: %w", cfg.AdminAddr, err)
	}
	mets := newMetrics(pool, pub, spendConsumer, alertConsumer, deliverer, seedResponder)
	mux := http.NewServeMux()
	mux.Handle("/", admin.NewHandler(admin.Options{Store: st, Peppers: peppers, BootstrapToken: cfg.BootstrapToken,
		KeyRing: ring, Logger: log, Observe: mets.observe, MaxRequestBytes: cfg.AdminMaxRequestBytes, NATS: nc}))
	mux.Handle("GET /metrics", mets.handler())
	console.Mount(mux) // the web console (static files calling the admin API above)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := pool.Ping(ctx); err != nil {
			http.Error(w, "postgres unreachable", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	// Every admin request is bounded before it is authenticated: headers
	// (size and time), the whole request's read time, and (in the admin
	// handler) the body size. On h2c the read and write timeouts apply to
	// each stream.
	srv := &http.Server{
		Handler:           mux,
		Protocols:         protocols,
		ReadHeaderTimeout: min(DefaultAdminReadHeaderTimeout, cfg.AdminReadTimeout),
		ReadTimeout:       cfg.AdminReadTimeout,
		WriteTimeout:      DefaultAdminWriteTimeout,
		IdleTimeout:       DefaultAdminIdleTimeout,
		MaxHeaderBytes:    adminMaxHeaderBytes,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:          adminMaxConcurrentStreams,
			MaxReceiveBufferPerStream:     1 << 20,
			MaxReceiveBufferPerConnection: 4 << 20,
		},
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	if cfg.BootstrapToken == "" {
		log.Warn("no bootstrap admin token configured (SLUICE_ADMIN_TOKEN); only admin tokens from the database are accepted")
	}
	return &ControlPlane{cfg: cfg, log: log, pool: pool, ln: ln, srv: srv, store: st, nc: nc, pub: pub, spend: spendConsumer,
		alerts: alertConsumer, deliver: deliverer, seeds: seedResponder, auditExport: auditExp}, nil
}

// Addr returns the admin API's bound address.
func (c *ControlPlane) Addr() string { return c.ln.Addr().String() }

// component is a long-lived part of the control plane: it runs until ctx
// is done (returning nil) or it fails (returning why).
type component interface {
	Run(ctx context.Context) error
}

// Run runs every component (admin server, publisher, spend and alert
// consumers, seed responder) under one errgroup until ctx is done, then
// shuts down gracefully and releases NATS and the database pool. The first
// component to fail stops the others, and Run returns its error, named
// after the component (the caller reports it, once); later errors are
// consequences and only joined in if they are not cancellations.
func (c *ControlPlane) Run(ctx context.Context) error {
	defer c.pool.Close()
	defer c.nc.Close()
	components := []struct {
		name string
		c    component
	}{
		{"admin server", &adminServer{srv: c.srv, ln: c.ln, shutdownTimeout: c.cfg.ShutdownTimeout}},
		{"publisher", c.pub},
		{"spend consumer", c.spend},
		{"alert consumer", c.alerts},
		{"alert deliverer", c.deliver},
		{"seed responder", c.seeds},
		{"audit exporter", c.auditExport},
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, comp := range components {
		g.Go(func() error {
			if err := comp.c.Run(gctx); err != nil {
				return fmt.Errorf("%s: %w", comp.name, err)
			}
			if gctx.Err() == nil {
				// A component that ends on its own while the plane runs
				// would leave it half-working: stop the plane instead.
				return fmt.Errorf("%s: %w", comp.name, errStoppedEarly)
			}
			return nil
		})
	}
	c.log.Info("control plane serving", "admin_addr", c.Addr(), "pid", os.Getpid())
	if err := g.Wait(); err != nil {
		return err
	}
	c.log.Info("control plane stopped")
	return nil
}

// errStoppedEarly is a component returning while the plane still runs.
var errStoppedEarly = errors.New("stopped before the control plane did")

// adminServer serves the admin API on ln until ctx is done, then shuts
// down gracefully within shutdownTimeout.
type adminServer struct {
	srv             *http.Server
	ln              net.Listener
	shutdownTimeout time.Duration
}

// Run serves until ctx is done or the server fails.
func (a *adminServer) Run(ctx context.Context) error {
	errc := make(chan error, 1)
	go func() { errc <- a.srv.Serve(a.ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.shutdownTimeout)
	defer cancel()
	if err := a.srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutdown: %w", err)
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// dataPlaneFrom converts a heartbeat to the fleet row.
func dataPlaneFrom(hb *configv1.Heartbeat) store.DataPlane {
	d := store.DataPlane{
		InstanceID: hb.GetInstanceId(), Region: hb.GetRegion(), AppliedVersion: hb.GetAppliedVersion(),
		EventsSeq: hb.GetEventsSeq(), RegionSeq: hb.GetRegionSeq(), Health: hb.GetHealth(), InFlight: hb.GetInFlight(),
		StalenessSeconds: hb.GetStalenessSeconds(),
	}
	for _, r := range hb.GetRejected() {
		d.Rejected = append(d.Rejected, store.RejectedSnapshot{Version: r.GetVersion(), Reason: r.GetReason(), Time: r.GetAt().AsTime()})
	}
	if r := hb.GetRejecting(); r != nil {
		d.Rejecting = &store.Rejecting{Version: r.GetVersion(), RunningVersion: r.GetRunningVersion(), Reason: r.GetReason(),
			Since: r.GetSince().AsTime(), PastBound: r.GetPastBound()}
	}
	for _, e := range hb.GetEjected() {
		ej := store.EjectedDeployment{DeploymentID: e.GetDeploymentId(), ModelGroup: e.GetModelGroup(), Reason: e.GetReason()}
		if e.GetUntil() != nil {
			t := e.GetUntil().AsTime()
			ej.Until = &t
		}
		d.Ejected = append(d.Ejected, ej)
	}
	for _, b := range hb.GetAdmissionBacklog() {
		d.Backlog = append(d.Backlog, store.ClassBacklog{TrafficClass: b.GetTrafficClass(), InFlight: b.GetInFlight(), Queued: b.GetQueued(), Shed: b.GetShed()})
	}
	return d
}
