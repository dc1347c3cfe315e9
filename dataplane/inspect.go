package dataplane

// This file is the data plane's inspection surface: thin, read-mostly
// accessors and re-exported wire constants for the end-to-end tests in e2e/
// (which cannot import dataplane/internal/...) and for operators embedding
// the data plane. Each accessor delegates in one line to the component that
// owns the state; none is used on the request path.

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	apiproxy "github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/dataplane/internal/usage"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// Catalog is the immutable view of one snapshot (plus the events applied
// on top of it) that the data plane serves from.
type Catalog = catalog.Catalog

// Deployment is one model deployment of a Catalog.
type Deployment = catalog.Deployment

// SyncStats counts what the config sync applied, rejected and skipped.
type SyncStats = configsync.Stats

// UsageStats describes the usage publisher's buffer, spool and counters.
type UsageStats = usage.Stats

// CatalogFromSnapshot builds the catalog a data plane would serve from
// snapshot s at region sequence regionSeq (for tests comparing a data
// plane's catalog with a freshly built one, and benchmarks of the build).
func CatalogFromSnapshot(s *configv1.Snapshot, regionSeq uint64) (*Catalog, error) {
	return catalog.FromSnapshot(s, regionSeq, nil)
}

// Catalog returns the catalog being served (nil before the first snapshot).
func (d *DataPlane) Catalog() *Catalog { return d.sync.Catalog() }

// Ready reports whether a snapshot has been loaded.
func (d *DataPlane) Ready() bool { return d.sync.Ready() }

// SyncStats returns the config sync's counters.
func (d *DataPlane) SyncStats() SyncStats { return d.sync.Stats() }

// Staleness is the time since the data plane last heard from the control
// plane (a snapshot, an event or a pointer).
func (d *DataPlane) Staleness() time.Duration { return d.sync.Staleness() }

// Rejecting describes the snapshot the data plane currently refuses to
// apply (nil when it applies what it is sent).
func (d *DataPlane) Rejecting() *configv1.Rejecting { return d.sync.Rejecting() }

// Rejected lists the snapshots the data plane refused, most recent last.
func (d *DataPlane) Rejected() []*configv1.RejectedSnapshot { return d.sync.Rejected() }

// Drain waits until every settlement the proxy queued has been written
// (or ctx ends), then gives back the quota slices the data plane holds.
func (d *DataPlane) Drain(ctx context.Context) error { return d.proxy.Drain(ctx) }

// DrainSettlements waits until no limits settlement is pending, keeping
// the quota slices held (Drain also gives them back).
func (d *DataPlane) DrainSettlements(ctx context.Context) error { return d.proxy.DrainSettlements(ctx) }

// BodyReads is the number of request bodies being read right now.
func (d *DataPlane) BodyReads() int64 { return d.proxy.BodyReads() }

// UsageStats returns the usage publisher's counters.
func (d *DataPlane) UsageStats() UsageStats { return d.usage.Stats() }

// LimitSliceStats is what the data plane's quota slices hold.
type LimitSliceStats struct {
	Scopes                   int   // scopes with slice state
	HeldRequests, HeldTokens int64 // usable now
	CarveCalls               int64 // the slice worker's carve.lua calls so far
	// HeldSlots are the concurrency slots held (free or in use), SlotsInUse
	// those in use by a request.
	HeldSlots, SlotsInUse int64
}

// LimitSliceStats reports the quota slices the data plane holds and the
// slice worker's Redis calls so far (zero with --limit-slices off).
func (d *DataPlane) LimitSliceStats() LimitSliceStats {
	if d.lim == nil {
		return LimitSliceStats{}
	}
	st := d.lim.SliceStats()
	return LimitSliceStats{Scopes: st.Scopes, HeldRequests: st.HeldR, HeldTokens: st.HeldT, CarveCalls: st.Calls,
		HeldSlots: st.HeldSlots, SlotsInUse: st.SlotsInUse}
}

// RecordUsage queues a usage event for publishing, as the proxy does when
// a request settles.
func (d *DataPlane) RecordUsage(ev *usagev1.UsageEvent) { d.usage.Record(ev) }

// OpenConns is the number of client connections open right now.
func (d *DataPlane) OpenConns() int64 { return d.openConns.Load() }

// Config returns the configuration the data plane runs with (defaults
// applied).
func (d *DataPlane) Config() Config { return d.cfg }

// Gatherer exposes the registry behind /metrics.
func (d *DataPlane) Gatherer() prometheus.Gatherer { return d.registry }

// Wire constants of the OpenAI-compatible surface: routes, headers and the
// stable error codes and types clients see.
const (
	CodeBodyReadsSaturated       = apiproxy.CodeBodyReadsSaturated
	CodeBodyTimeout              = apiproxy.CodeBodyTimeout
	CodeBudgetExceeded           = apiproxy.CodeBudgetExceeded
	CodeClientClosed             = apiproxy.CodeClientClosed
	CodeConcurrencyLimitExceeded = apiproxy.CodeConcurrencyLimitExceeded
	CodeCustomerBlocked          = apiproxy.CodeCustomerBlocked
	CodeEstimateTooLarge         = apiproxy.CodeEstimateTooLarge
	CodeIncompleteBody           = apiproxy.CodeIncompleteBody
	CodeInvalidAPIKey            = apiproxy.CodeInvalidAPIKey
	CodeInvalidJSON              = apiproxy.CodeInvalidJSON
	CodeInvalidParameter         = apiproxy.CodeInvalidParameter
	CodeLimitsRecovering         = apiproxy.CodeLimitsRecovering
	CodeLimitsUnavailable        = apiproxy.CodeLimitsUnavailable
	CodeMissingAPIKey            = apiproxy.CodeMissingAPIKey
	CodeModelNotAllowed          = apiproxy.CodeModelNotAllowed
	CodeModelNotFound            = apiproxy.CodeModelNotFound
	CodeOverloaded               = apiproxy.CodeOverloaded
	CodeProxyLost                = apiproxy.CodeProxyLost
	CodeRateLimitExceeded        = apiproxy.CodeRateLimitExceeded
	CodeTokenRateLimitExceeded   = apiproxy.CodeTokenRateLimitExceeded
	CodeTooManyConcurrentBodies  = apiproxy.CodeTooManyConcurrentBodies
	CodeUpstreamAuthFailed       = apiproxy.CodeUpstreamAuthFailed
	CodeUpstreamBadRequest       = apiproxy.CodeUpstreamBadRequest
	CodeUpstreamRateLimited      = apiproxy.CodeUpstreamRateLimited
	CodeUpstreamOverloaded       = apiproxy.CodeUpstreamOverloaded
	CodeUpstreamTimeout          = apiproxy.CodeUpstreamTimeout
	CodeUpstreamError            = apiproxy.CodeUpstreamError
	HeaderAttempts               = apiproxy.HeaderAttempts
	HeaderModelGroup             = apiproxy.HeaderModelGroup
	HeaderAgentID                = apiproxy.HeaderAgentID
	HeaderEndUser                = apiproxy.HeaderEndUser
	HeaderLimitScope             = apiproxy.HeaderLimitScope
	HeaderLimitType              = apiproxy.HeaderLimitType
	HeaderSession                = apiproxy.HeaderSession
	RouteChat                    = apiproxy.RouteChat
	RouteCompletions             = apiproxy.RouteCompletions
	RouteEmbeddings              = apiproxy.RouteEmbeddings
	StatusClientClosed           = apiproxy.StatusClientClosed
	TypeBudgetExceeded           = apiproxy.TypeBudgetExceeded
)
