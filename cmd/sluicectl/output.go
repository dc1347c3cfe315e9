package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"
	"sigs.k8s.io/yaml"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Output formats.
const (
	outTable = "table"
	outJSON  = "json"
	outYAML  = "yaml"
)

func validOutput(o string) error {
	switch o {
	case outTable, outJSON, outYAML:
		return nil
	}
	return fmt.Errorf("-o %q: want table, json or yaml", o)
}

var marshalJSON = protojson.MarshalOptions{UseProtoNames: true}

// column is one column of a list table.
type column[T any] struct {
	title string
	value func(T) string
}

// printer writes command results in the chosen format.
type printer struct {
	w      io.Writer
	format string
}

// encode writes JSON (indented) or YAML of compact JSON b.
func (p printer) encode(b []byte) error {
	if p.format == outYAML {
		y, err := yaml.JSONToYAML(b)
		if err != nil {
			return fmt.Errorf("encode yaml: %w", err)
		}
		_, err = p.w.Write(y)
		return err
	}
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "  "); err != nil {
		return fmt.Errorf("encode json: %w", err)
	}
	buf.WriteByte('\n')
	_, err := p.w.Write(buf.Bytes())
	return err
}

// message writes m as JSON or YAML. It must not be called for tables.
func (p printer) message(m proto.Message) error {
	b, err := marshalJSON.Marshal(m)
	if err != nil {
		return fmt.Errorf("encode %s: %w", m.ProtoReflect().Descriptor().Name(), err)
	}
	return p.encode(b)
}

// one writes a single object: JSON/YAML of full (the whole response, e.g.
// with a new token), or in table mode a FIELD/VALUE view of obj followed
// by extra rows.
func (p printer) one(full, obj proto.Message, extra ...[2]string) error {
	if p.format != outTable {
		return p.message(full)
	}
	var rows [][2]string
	detailRows(obj.ProtoReflect(), "", &rows)
	rows = append(rows, extra...)
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	for _, r := range rows {
		fmt.Fprintf(tw, "%s:\t%s\n", r[0], r[1])
	}
	return tw.Flush()
}

// list writes items as a table with cols, or as a JSON/YAML array.
func list[T proto.Message](p printer, items []T, cols []column[T]) error {
	if p.format != outTable {
		var buf bytes.Buffer
		buf.WriteByte('[')
		for i, it := range items {
			if i > 0 {
				buf.WriteByte(',')
			}
			b, err := marshalJSON.Marshal(it)
			if err != nil {
				return fmt.Errorf("encode: %w", err)
			}
			buf.Write(b)
		}
		buf.WriteByte(']')
		return p.encode(buf.Bytes())
	}
	tw := tabwriter.NewWriter(p.w, 0, 4, 2, ' ', 0)
	titles := make([]string, len(cols))
	for i, c := range cols {
		titles[i] = c.title
	}
	fmt.Fprintln(tw, strings.Join(titles, "\t"))
	for _, it := range items {
		vals := make([]string, len(cols))
		for i, c := range cols {
			vals[i] = cell(c.value(it))
		}
		fmt.Fprintln(tw, strings.Join(vals, "\t"))
	}
	return tw.Flush()
}

// cell makes a table cell: never empty (a dash), never multi-line.
func cell(s string) string {
	if s == "" {
		return "-"
	}
	return strings.NewReplacer("\t", " ", "\n", " ").Replace(s)
}

// detailRows flattens m into FIELD/VALUE rows in declaration order; nested
// messages (limits) become dotted names. Unset fields are left out.
func detailRows(m protoreflect.Message, prefix string, rows *[][2]string) {
	fds := m.Descriptor().Fields()
	for i := range fds.Len() {
		fd := fds.Get(i)
		// Booleans without presence (blocked) are shown when false too:
		// "blocked: false" is information, not an unset field.
		showFalse := fd.Kind() == protoreflect.BoolKind && !fd.HasPresence() && !fd.IsList()
		if !m.Has(fd) && !showFalse {
			continue
		}
		name := prefix + string(fd.Name())
		v := m.Get(fd)
		switch {
		case fd.IsMap():
			*rows = append(*rows, [2]string{name, formatMap(fd, v.Map())})
		case fd.IsList():
			l := v.List()
			parts := make([]string, l.Len())
			for j := range l.Len() {
				parts[j] = formatScalar(fd, l.Get(j))
			}
			*rows = append(*rows, [2]string{name, strings.Join(parts, ", ")})
		case fd.Kind() == protoreflect.MessageKind && fd.Message().FullName() != timestampName:
			detailRows(v.Message(), name+".", rows)
		default:
			*rows = append(*rows, [2]string{name, formatScalar(fd, v)})
		}
	}
}

const timestampName = "google.protobuf.Timestamp"

func formatMap(fd protoreflect.FieldDescriptor, m protoreflect.Map) string {
	var parts []string
	m.Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
		parts = append(parts, k.String()+"="+formatScalar(fd.MapValue(), v))
		return true
	})
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

func formatScalar(fd protoreflect.FieldDescriptor, v protoreflect.Value) string {
	switch fd.Kind() {
	case protoreflect.EnumKind:
		return enumName(fd.Enum(), v.Enum())
	case protoreflect.BytesKind:
		return hex.EncodeToString(v.Bytes())
	case protoreflect.DoubleKind, protoreflect.FloatKind:
		return strconv.FormatFloat(v.Float(), 'f', -1, 64)
	case protoreflect.MessageKind:
		if ts, ok := v.Message().Interface().(*timestamppb.Timestamp); ok {
			return formatTime(ts)
		}
		b, _ := marshalJSON.Marshal(v.Message().Interface())
		return string(b)
	}
	return v.String()
}

// enumName is the lower-case value name without the enum's prefix
// (TRAFFIC_CLASS_BATCH → batch).
func enumName(ed protoreflect.EnumDescriptor, n protoreflect.EnumNumber) string {
	vd := ed.Values().ByNumber(n)
	if vd == nil {
		return strconv.Itoa(int(n))
	}
	prefix := strings.TrimSuffix(string(ed.Values().ByNumber(0).Name()), "UNSPECIFIED")
	return strings.ToLower(strings.TrimPrefix(string(vd.Name()), prefix))
}

func formatTime(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return ts.AsTime().UTC().Format(time.RFC3339)
}

// limitsSummary is a one-cell summary of limits for list tables.
func limitsSummary(l *adminv1.Limits) string {
	if l == nil {
		return ""
	}
	var parts []string
	money := func(f float64) string { return "$" + strconv.FormatFloat(f, 'f', -1, 64) }
	if l.MaxBudget != nil {
		parts = append(parts, "budget="+money(l.GetMaxBudget())+"/"+l.GetBudgetDuration())
	}
	if l.SoftBudget != nil {
		parts = append(parts, "soft="+money(l.GetSoftBudget()))
	}
	if l.RpmLimit != nil {
		parts = append(parts, "rpm="+strconv.FormatInt(l.GetRpmLimit(), 10))
	}
	if l.TpmLimit != nil {
		parts = append(parts, "tpm="+strconv.FormatInt(l.GetTpmLimit(), 10))
	}
	if l.MaxParallelRequests != nil {
		parts = append(parts, "parallel="+strconv.FormatInt(l.GetMaxParallelRequests(), 10))
	}
	if len(l.AllowedModels) > 0 {
		parts = append(parts, "models="+strings.Join(l.AllowedModels, ","))
	}
	if n := len(l.ModelMaxBudget) + len(l.ModelRpmLimit) + len(l.ModelTpmLimit); n > 0 {
		parts = append(parts, fmt.Sprintf("per-model=%d", n))
	}
	return strings.Join(parts, " ")
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func trafficClass(tc adminv1.TrafficClass) string {
	if tc == adminv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED {
		return ""
	}
	return enumName(tc.Descriptor(), tc.Number())
}

// encodeJSONValue writes a plain Go value as JSON or YAML.
func encodeJSONValue(p printer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	return p.encode(b)
}

// result prints obj (p.one), or returns err: the tail of a command that
// calls the API and prints the object it answers.
func (p printer) result(obj proto.Message, err error) error {
	if err != nil {
		return err
	}
	return p.one(obj, obj)
}
