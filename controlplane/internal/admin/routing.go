package admin

import (
	"math"
	"time"

	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Routing strategies of a model group (docs/routing.md, "Strategies").
// "" is the defaults by traffic class.
const (
	StrategyWeightedShuffle  = "weighted_shuffle"
	StrategyAffinity         = "affinity"
	StrategyLeastOutstanding = "least_outstanding"
	StrategyEngineLoad       = "engine_load"
)

// strategies are the strategy names the admin API accepts.
var strategies = []string{StrategyWeightedShuffle, StrategyAffinity, StrategyLeastOutstanding, StrategyEngineLoad}

// Routing bounds: a pin shorter than a second is no pin, one longer than
// a week outlives any agent loop; c below 1 would bound a replica under
// the mean load (no placement fits), above 10 it bounds nothing.
const (
	minSessionTTL  = time.Second
	maxSessionTTL  = 7 * 24 * time.Hour
	minLoadFactor  = 1.0
	maxLoadFactor  = 10.0
	routingMaskTop = "routing"
)

// pinsSessions reports whether strategy s reads session pins and hashes
// with bounded load (the default and affinity): session_ttl and
// load_factor are only accepted with those, so no setting is dead.
func pinsSessions(s string) bool { return s == "" || s == StrategyAffinity }

// validateRouting checks a model group's routing settings, naming every
// bad field under prefix ("routing").
func validateRouting(c *validator, prefix string, r *adminv1.ModelGroupRouting) {
	if r == nil {
		return
	}
	s := r.GetStrategy()
	known := s == ""
	for _, k := range strategies {
		known = known || s == k
	}
	if !known {
		c.add(prefix+".strategy", "unknown strategy %q (known: weighted_shuffle, affinity, least_outstanding, engine_load; empty for the defaults)", s)
	}
	if d := r.GetSessionTtl(); d != nil {
		switch err := d.CheckValid(); {
		case err != nil:
			c.add(prefix+".session_ttl", "invalid duration: %v", err)
		case d.AsDuration() < minSessionTTL || d.AsDuration() > maxSessionTTL:
			c.add(prefix+".session_ttl", "must be between %s and %s (got %s)", minSessionTTL, maxSessionTTL, d.AsDuration())
		case known && !pinsSessions(s):
			c.add(prefix+".session_ttl", "strategy %q pins no sessions; set session_ttl only with affinity or the default strategy", s)
		}
	}
	if f := r.GetLoadFactor(); f != 0 {
		switch {
		case math.IsNaN(f) || f < minLoadFactor || f > maxLoadFactor:
			c.add(prefix+".load_factor", "must be 0 (the default, 1.25) or between %g and %g (got %g)", minLoadFactor, maxLoadFactor, f)
		case known && !pinsSessions(s):
			c.add(prefix+".load_factor", "strategy %q has no bounded-load hashing; set load_factor only with affinity or the default strategy", s)
		}
	}
}

// routingJSON is the stored form of r (nil or empty: "{}").
func routingJSON(r *adminv1.ModelGroupRouting) []byte {
	if r == nil || proto.Size(r) == 0 {
		return []byte("{}")
	}
	return trafficJSON(r)
}

// routingFromJSON decodes stored routing settings; nil when none are set.
func routingFromJSON(b []byte) (*adminv1.ModelGroupRouting, error) {
	r := &adminv1.ModelGroupRouting{}
	if err := trafficFromJSON(b, r); err != nil {
		return nil, err
	}
	if proto.Size(r) == 0 {
		return nil, nil
	}
	return r, nil
}
