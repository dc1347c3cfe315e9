package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// fields registers the flags of an object's settable fields on a flag set
// and remembers, for each flag, the update_mask path it changes. create
// commands use the values; update commands also build the mask from
// exactly the flags the user gave (flag.Visit).
type fields struct {
	fs    *flag.FlagSet
	paths map[string]string // flag name → update_mask path
	names []string          // flag names in registration order
	clear stringList        // --clear FLAG (update commands only)
}

func newFields(fs *flag.FlagSet) *fields {
	return &fields{fs: fs, paths: map[string]string{}}
}

func (f *fields) add(name, path string, v flag.Value, usage string) {
	f.fs.Var(v, name, usage)
	f.paths[name] = path
	f.names = append(f.names, name)
}

// String registers a string field.
func (f *fields) String(p *string, name, path, usage string) {
	f.add(name, path, (*stringValue)(p), usage)
}

// Int64 registers an optional whole-number field.
func (f *fields) Int64(p **int64, name, path, usage string) {
	f.add(name, path, &optInt64{p}, usage)
}

// Float registers an optional number field.
func (f *fields) Float(p **float64, name, path, usage string) {
	f.add(name, path, &optFloat{p}, usage)
}

// List registers a list field: comma-separated, repeatable.
func (f *fields) List(p *[]string, name, path, usage string) {
	f.add(name, path, &stringList{p: p}, usage)
}

// Map registers a string map field: KEY=VALUE, repeatable.
func (f *fields) Map(p *map[string]string, name, path, usage string) {
	f.add(name, path, &kvMap{p}, usage)
}

// FloatMap registers a map of numbers: KEY=NUMBER, repeatable.
func (f *fields) FloatMap(p *map[string]float64, name, path, usage string) {
	f.add(name, path, &floatMap{p}, usage)
}

// IntMap registers a map of whole numbers: KEY=N, repeatable.
func (f *fields) IntMap(p *map[string]int64, name, path, usage string) {
	f.add(name, path, &intMap{p}, usage)
}

// Time registers a time field: RFC 3339 or a duration from now.
func (f *fields) Time(p **timestamppb.Timestamp, name, path, usage string) {
	f.add(name, path, &timeValue{p: p}, usage)
}

// TrafficClass registers a traffic class field.
func (f *fields) TrafficClass(p *adminv1.TrafficClass, name, path, usage string) {
	f.add(name, path, &trafficClassValue{p}, usage)
}

// limitLevel says which limit flags a tenancy level takes (the server
// rejects the others; not offering them gives the clearer error).
type limitLevel int

const (
	limitsBasic    limitLevel = iota // orgs, users, customers
	limitsPerModel                   // teams and keys: also per-model limits
	limitsMember                     // team members: no max budget, models or per-model
	limitsLabel                      // project and tag scopes: no models or per-model
)

// Limits registers the limit flags of level lvl on *p (allocated here).
func (f *fields) Limits(p **adminv1.Limits, lvl limitLevel) {
	if *p == nil {
		*p = &adminv1.Limits{}
	}
	l := *p
	if lvl != limitsMember {
		f.Float(&l.MaxBudget, "max-budget", "limits.max_budget", "hard budget in USD per budget window")
	}
	f.String(&l.BudgetDuration, "budget-duration", "limits.budget_duration", "budget window, `WINDOW`: <n>h, <n>d or <n>mo (e.g. 1d, 30d, 1mo)")
	f.Float(&l.SoftBudget, "soft-budget", "limits.soft_budget", "soft budget in USD per window (alerts only)")
	f.Int64(&l.RpmLimit, "rpm-limit", "limits.rpm_limit", "requests per minute")
	f.Int64(&l.TpmLimit, "tpm-limit", "limits.tpm_limit", "tokens per minute")
	f.Int64(&l.MaxParallelRequests, "max-parallel-requests", "limits.max_parallel_requests", "requests in flight at once")
	if lvl == limitsMember || lvl == limitsLabel {
		return
	}
	f.List(&l.AllowedModels, "allowed-models", "limits.allowed_models", "allowed model groups, comma-separated (empty: no restriction)")
	if lvl != limitsPerModel {
		return
	}
	f.FloatMap(&l.ModelMaxBudget, "model-max-budget", "limits.model_max_budget", "per-model budget in USD (repeatable)")
	f.IntMap(&l.ModelRpmLimit, "model-rpm-limit", "limits.model_rpm_limit", "per-model requests per minute (repeatable)")
	f.IntMap(&l.ModelTpmLimit, "model-tpm-limit", "limits.model_tpm_limit", "per-model tokens per minute (repeatable)")
}

// Metadata registers --metadata.
func (f *fields) Metadata(p *map[string]string) {
	f.Map(p, "metadata", "metadata", "metadata entry (repeatable; on update it replaces all metadata)")
}

// Clearable registers --clear for update commands: it names fields to
// reset to unset (no limit, no expiry, empty list).
func (f *fields) Clearable() {
	f.fs.Var(&f.clear, "clear", "reset a field to unset, named by its flag (e.g. --clear rpm-limit); repeatable")
}

// updateMask returns the update_mask of exactly the field flags that were
// given (and --clear), in registration order. It fails when nothing would
// change, or when a flag is both set and cleared.
func (f *fields) updateMask() (*fieldmaskpb.FieldMask, error) {
	given := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) {
		if _, ok := f.paths[fl.Name]; ok {
			given[fl.Name] = true
		}
	})
	var clearErr error
	cleared := map[string]bool{}
	for _, c := range f.clear.values() {
		c = strings.TrimLeft(c, "-")
		if _, ok := f.paths[c]; !ok {
			clearErr = errors.Join(clearErr, fmt.Errorf("--clear %s: not a field of this command (fields: %s)", c, strings.Join(f.names, ", ")))
			continue
		}
		if given[c] {
			clearErr = errors.Join(clearErr, fmt.Errorf("--%s is both set and cleared", c))
		}
		cleared[c] = true
	}
	if clearErr != nil {
		return nil, clearErr
	}
	var paths []string
	for _, n := range f.names {
		if (given[n] || cleared[n]) && !slices.Contains(paths, f.paths[n]) {
			paths = append(paths, f.paths[n])
		}
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("nothing to update: give at least one of --%s (or --clear FLAG)", strings.Join(f.names, ", --"))
	}
	return &fieldmaskpb.FieldMask{Paths: paths}, nil
}

// stringValue is a plain string flag.
type stringValue string

func (s *stringValue) String() string     { return string(*s) }
func (s *stringValue) Set(v string) error { *s = stringValue(v); return nil }

// optInt64 is an optional int64 (unset: nil).
type optInt64 struct{ p **int64 }

func (o *optInt64) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return strconv.FormatInt(**o.p, 10)
}

func (o *optInt64) Set(v string) error {
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil {
		return errors.New("want a whole number")
	}
	*o.p = &n
	return nil
}

// optFloat is an optional float64 (unset: nil).
type optFloat struct{ p **float64 }

func (o *optFloat) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return strconv.FormatFloat(**o.p, 'f', -1, 64)
}

func (o *optFloat) Set(v string) error {
	n, err := parseNumber(v)
	if err != nil {
		return err
	}
	*o.p = &n
	return nil
}

func parseNumber(v string) (float64, error) {
	n, err := strconv.ParseFloat(strings.TrimPrefix(strings.TrimSpace(v), "$"), 64)
	if err != nil || math.IsNaN(n) || math.IsInf(n, 0) {
		return 0, errors.New("want a number, e.g. 1.5")
	}
	return n, nil
}

// optBool is an optional boolean filter (unset: nil).
type optBool struct{ p **bool }

func (o *optBool) IsBoolFlag() bool { return true }

func (o *optBool) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return strconv.FormatBool(**o.p)
}

func (o *optBool) Set(v string) error {
	b, err := strconv.ParseBool(v)
	if err != nil {
		return errors.New("want true or false")
	}
	*o.p = &b
	return nil
}

// stringList is a comma-separated, repeatable list. An empty value gives
// an empty list (useful to clear a list on update).
type stringList struct {
	p   *[]string
	own []string
}

func (l *stringList) values() []string {
	if l.p == nil {
		return l.own
	}
	return *l.p
}

func (l *stringList) String() string { return strings.Join(l.values(), ",") }

func (l *stringList) Set(v string) error {
	if l.p == nil {
		l.p = &l.own
	}
	for item := range strings.SplitSeq(v, ",") {
		if item = strings.TrimSpace(item); item != "" {
			*l.p = append(*l.p, item)
		}
	}
	return nil
}

// splitKV splits "KEY=VALUE".
func splitKV(v string) (string, string, error) {
	k, val, ok := strings.Cut(v, "=")
	k = strings.TrimSpace(k)
	if !ok || k == "" {
		return "", "", fmt.Errorf("want KEY=VALUE, got %q", v)
	}
	return k, val, nil
}

// kvMap is a repeatable KEY=VALUE map of strings.
type kvMap struct{ p *map[string]string }

func (m *kvMap) String() string {
	if m.p == nil {
		return ""
	}
	return joinMap(*m.p, func(s string) string { return s })
}

func (m *kvMap) Set(v string) error {
	if *m.p == nil {
		*m.p = map[string]string{}
	}
	if v == "" { // --metadata "" on update: empty map
		return nil
	}
	k, val, err := splitKV(v)
	if err != nil {
		return err
	}
	(*m.p)[k] = val
	return nil
}

// floatMap is a repeatable MODEL=NUMBER map.
type floatMap struct{ p *map[string]float64 }

func (m *floatMap) String() string {
	if m.p == nil {
		return ""
	}
	return joinMap(*m.p, func(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) })
}

func (m *floatMap) Set(v string) error {
	if *m.p == nil {
		*m.p = map[string]float64{}
	}
	if v == "" {
		return nil
	}
	k, val, err := splitKV(v)
	if err != nil {
		return fmt.Errorf("want MODEL=USD, got %q", v)
	}
	n, err := parseNumber(val)
	if err != nil {
		return fmt.Errorf("%s: %w", k, err)
	}
	(*m.p)[k] = n
	return nil
}

// intMap is a repeatable MODEL=N map.
type intMap struct{ p *map[string]int64 }

func (m *intMap) String() string {
	if m.p == nil {
		return ""
	}
	return joinMap(*m.p, func(n int64) string { return strconv.FormatInt(n, 10) })
}

func (m *intMap) Set(v string) error {
	if *m.p == nil {
		*m.p = map[string]int64{}
	}
	if v == "" {
		return nil
	}
	k, val, err := splitKV(v)
	if err != nil {
		return fmt.Errorf("want MODEL=N, got %q", v)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(val), 10, 64)
	if err != nil {
		return fmt.Errorf("%s: want a whole number, got %q", k, val)
	}
	(*m.p)[k] = n
	return nil
}

func joinMap[V any](m map[string]V, format func(V) string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + format(m[k])
	}
	return strings.Join(parts, ",")
}

// timeValue is a point in time given as RFC 3339 ("2026-01-31T00:00:00Z"),
// a date ("2026-01-31", midnight UTC) or a duration from now ("30d",
// "12h", "1d12h"). "" or "never" leaves it unset.
type timeValue struct {
	p   **timestamppb.Timestamp
	now func() time.Time
}

func (t *timeValue) String() string {
	if t.p == nil || *t.p == nil {
		return ""
	}
	return (*t.p).AsTime().Format(time.RFC3339)
}

func (t *timeValue) Set(v string) error {
	now := time.Now
	if t.now != nil {
		now = t.now
	}
	tm, err := parseTime(v, now())
	if err != nil {
		return err
	}
	if tm.IsZero() {
		*t.p = nil
		return nil
	}
	*t.p = timestamppb.New(tm)
	return nil
}

// parseTime parses an absolute time or a duration from now; "" and
// "never" give the zero time.
func parseTime(v string, now time.Time) (time.Time, error) {
	v = strings.TrimSpace(v)
	if v == "" || v == "never" {
		return time.Time{}, nil
	}
	if tm, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return tm, nil
	}
	if tm, err := time.Parse(time.DateOnly, v); err == nil {
		return tm, nil
	}
	d, err := parseDuration(v)
	if err != nil {
		return time.Time{}, fmt.Errorf("want RFC 3339 time (2026-01-31T00:00:00Z), a date (2026-01-31) or a duration from now (30d, 12h), got %q", v)
	}
	if d <= 0 {
		return time.Time{}, fmt.Errorf("duration %q must be positive", v)
	}
	return now.Add(d).UTC().Truncate(time.Second), nil
}

// parseDuration parses a Go duration with an optional leading day count:
// "30d", "1d12h", "90m", "24h".
func parseDuration(v string) (time.Duration, error) {
	var days time.Duration
	if i := strings.IndexByte(v, 'd'); i >= 0 {
		n, err := strconv.ParseInt(v[:i], 10, 32)
		if err != nil || n < 0 {
			return 0, fmt.Errorf("bad day count in %q", v)
		}
		days = time.Duration(n) * 24 * time.Hour
		v = v[i+1:]
		if v == "" {
			return days, nil
		}
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, err
	}
	return days + d, nil
}

// sinceValue is a time filter: an absolute time or a duration ago ("1h"
// means one hour before now).
type sinceValue struct{ p **timestamppb.Timestamp }

func (s *sinceValue) String() string {
	if s.p == nil || *s.p == nil {
		return ""
	}
	return (*s.p).AsTime().Format(time.RFC3339)
}

func (s *sinceValue) Set(v string) error {
	v = strings.TrimSpace(v)
	if tm, err := time.Parse(time.RFC3339Nano, v); err == nil {
		*s.p = timestamppb.New(tm)
		return nil
	}
	if tm, err := time.Parse(time.DateOnly, v); err == nil {
		*s.p = timestamppb.New(tm)
		return nil
	}
	d, err := parseDuration(v)
	if err != nil || d <= 0 {
		return fmt.Errorf("want RFC 3339 time, a date (2026-01-31) or a duration ago (1h, 7d), got %q", v)
	}
	*s.p = timestamppb.New(time.Now().Add(-d))
	return nil
}

// enumValue is an enum flag taking the lower-case value names without the
// enum's prefix (TRAFFIC_CLASS_BATCH: batch); UNSPECIFIED is "".
type enumValue[E ~int32] struct {
	p      *E
	names  map[string]E
	accept string
}

func newEnum[E ~int32](p *E, values map[string]int32, prefix string) *enumValue[E] {
	e := &enumValue[E]{p: p, names: map[string]E{}}
	var list []string
	for name, n := range values {
		if n == 0 {
			continue
		}
		short := strings.ToLower(strings.TrimPrefix(name, prefix))
		e.names[short] = E(n)
		list = append(list, short)
	}
	sort.Slice(list, func(i, j int) bool { return e.names[list[i]] < e.names[list[j]] })
	e.accept = strings.Join(list, ", ")
	return e
}

func (e *enumValue[E]) String() string {
	if e.p == nil {
		return ""
	}
	for name, v := range e.names {
		if v == *e.p {
			return name
		}
	}
	return ""
}

func (e *enumValue[E]) Set(v string) error {
	v = strings.ToLower(strings.TrimSpace(v))
	if v == "" {
		*e.p = 0
		return nil
	}
	n, ok := e.names[v]
	if !ok {
		return fmt.Errorf("want one of %s", e.accept)
	}
	*e.p = n
	return nil
}

// trafficClassValue is --traffic-class interactive|agent|batch ("" unsets
// it: a key then takes its team's class).
type trafficClassValue struct{ p *adminv1.TrafficClass }

func (t *trafficClassValue) e() *enumValue[adminv1.TrafficClass] {
	return newEnum(t.p, adminv1.TrafficClass_value, "TRAFFIC_CLASS_")
}
func (t *trafficClassValue) String() string {
	if t.p == nil {
		return ""
	}
	return t.e().String()
}
func (t *trafficClassValue) Set(v string) error { return t.e().Set(v) }

// Placeholders for usage text ("--rpm-limit N").
func (*stringValue) placeholder() string         { return "TEXT" }
func (*optInt64) placeholder() string            { return "N" }
func (*optFloat) placeholder() string            { return "USD" }
func (*stringList) placeholder() string          { return "A,B,..." }
func (*kvMap) placeholder() string               { return "KEY=VALUE" }
func (*floatMap) placeholder() string            { return "MODEL=USD" }
func (*intMap) placeholder() string              { return "MODEL=N" }
func (*timeValue) placeholder() string           { return "TIME" }
func (*sinceValue) placeholder() string          { return "TIME" }
func (e *enumValue[E]) placeholder() string      { return strings.ReplaceAll(e.accept, ", ", "|") }
func (t *trafficClassValue) placeholder() string { return t.e().placeholder() }

// Duration registers a duration field (a Go duration: 90s, 2h).
func (f *fields) Duration(p **durationpb.Duration, name, path, usage string) {
	f.add(name, path, &durationValue{p}, usage)
}

type durationValue struct{ p **durationpb.Duration }

func (d *durationValue) String() string {
	if d.p == nil || *d.p == nil {
		return ""
	}
	return (*d.p).AsDuration().String()
}

func (d *durationValue) Set(v string) error {
	n, err := time.ParseDuration(strings.TrimSpace(v))
	if err != nil {
		return errors.New("want a duration, e.g. 90s or 2h")
	}
	*d.p = durationpb.New(n)
	return nil
}

// FloatValue registers a number field whose zero is its default.
func (f *fields) FloatValue(p *float64, name, path, usage string) {
	f.add(name, path, &floatValue{p}, usage)
}

type floatValue struct{ p *float64 }

func (o *floatValue) String() string {
	if o.p == nil {
		return ""
	}
	return strconv.FormatFloat(*o.p, 'f', -1, 64)
}

func (o *floatValue) Set(v string) error {
	n, err := parseNumber(v)
	if err != nil {
		return err
	}
	*o.p = n
	return nil
}

// Fallbacks registers per-group fallback overrides: GROUP=FB1,FB2,
// repeatable; GROUP= turns the group's fallbacks off.
func (f *fields) Fallbacks(p *map[string]*adminv1.ModelGroupFallbacks, name, path, usage string) {
	f.add(name, path, &fallbackMap{p}, usage)
}

// fallbackMap is a repeatable GROUP=FB1,FB2 map.
type fallbackMap struct {
	p *map[string]*adminv1.ModelGroupFallbacks
}

func (m *fallbackMap) String() string {
	if m.p == nil {
		return ""
	}
	return joinMap(*m.p, func(v *adminv1.ModelGroupFallbacks) string { return strings.Join(v.GetModelGroups(), ",") })
}

func (m *fallbackMap) Set(v string) error {
	if *m.p == nil {
		*m.p = map[string]*adminv1.ModelGroupFallbacks{}
	}
	if v == "" { // on update: no overrides
		return nil
	}
	k, val, err := splitKV(v)
	if err != nil {
		return err
	}
	fb := &adminv1.ModelGroupFallbacks{}
	for _, g := range strings.Split(val, ",") {
		if g = strings.TrimSpace(g); g != "" {
			fb.ModelGroups = append(fb.ModelGroups, g)
		}
	}
	(*m.p)[k] = fb
	return nil
}
