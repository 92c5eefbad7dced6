//! The OpenTelemetry SDK's in-memory exporter, read back as the points an
//! operator sees: shared by the metrics tests.

use std::collections::BTreeMap;

use opentelemetry::metrics::MeterProvider;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use tonic_retry::otel::GrpcMetrics;

/// A meter provider exporting to memory.
pub struct Exported {
    provider: SdkMeterProvider,
    exporter: InMemoryMetricExporter,
}

impl Exported {
    pub fn new() -> Self {
        let exporter = InMemoryMetricExporter::default();
        let provider = SdkMeterProvider::builder()
            .with_reader(PeriodicReader::builder(exporter.clone()).build())
            .build();
        Self { provider, exporter }
    }

    pub fn metrics(&self, target: &str) -> GrpcMetrics {
        GrpcMetrics::new(&self.provider.meter("tests"), target)
    }

    /// Has the provider collect and export what it holds (running any
    /// callbacks its instruments registered).
    pub fn flush(&self) {
        self.provider.force_flush().unwrap();
    }

    /// Whether the provider had nothing to export: no instrument was made
    /// on its meter, or none has a point.
    pub fn nothing(&self) -> bool {
        self.provider.force_flush().unwrap();
        let exported = self.exporter.get_finished_metrics().unwrap();
        exported.iter().all(|export| {
            export
                .scope_metrics()
                .all(|scope| scope.metrics().next().is_none())
        })
    }

    /// What the exporter has after a flush.
    pub fn collect(&self) -> Collected {
        self.provider.force_flush().unwrap();
        let exported = self.exporter.get_finished_metrics().unwrap();
        Collected(exported.into_iter().last().expect("an export"))
    }
}

pub struct Collected(ResourceMetrics);

/// One data point: its attributes, and count / sum / bounds (histograms) or
/// value (counters, gauges).
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub attributes: BTreeMap<String, String>,
    pub count: u64,
    pub sum: f64,
    pub bounds: Vec<f64>,
}

impl Collected {
    /// The unit and the points of the metric `name` (`None`: not exported).
    pub fn get(&self, name: &str) -> Option<(String, Vec<Point>)> {
        let metric = self
            .0
            .scope_metrics()
            .flat_map(|s| s.metrics())
            .find(|m| m.name() == name)?;
        let attributes = |kv: &mut dyn Iterator<Item = &opentelemetry::KeyValue>| {
            kv.map(|kv| (kv.key.to_string(), kv.value.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let points = match metric.data() {
            AggregatedMetrics::F64(MetricData::Histogram(h)) => h
                .data_points()
                .map(|p| Point {
                    attributes: attributes(&mut p.attributes()),
                    count: p.count(),
                    sum: p.sum(),
                    bounds: p.bounds().collect(),
                })
                .collect(),
            AggregatedMetrics::U64(MetricData::Histogram(h)) => h
                .data_points()
                .map(|p| Point {
                    attributes: attributes(&mut p.attributes()),
                    count: p.count(),
                    sum: p.sum() as f64,
                    bounds: p.bounds().collect(),
                })
                .collect(),
            AggregatedMetrics::U64(MetricData::Sum(s)) => s
                .data_points()
                .map(|p| Point {
                    attributes: attributes(&mut p.attributes()),
                    count: 1,
                    sum: p.value() as f64,
                    bounds: vec![],
                })
                .collect(),
            AggregatedMetrics::F64(MetricData::Gauge(g)) => g
                .data_points()
                .map(|p| Point {
                    attributes: attributes(&mut p.attributes()),
                    count: 1,
                    sum: p.value(),
                    bounds: vec![],
                })
                .collect(),
            other => panic!("{name}: unexpected data {other:?}"),
        };
        Some((metric.unit().to_owned(), points))
    }

    pub fn points(&self, name: &str) -> Vec<Point> {
        self.get(name).map(|(_, p)| p).unwrap_or_default()
    }

    /// The one point of `name` whose attributes include `with`.
    pub fn point(&self, name: &str, with: &[(&str, &str)]) -> Point {
        let matching: Vec<_> = self
            .points(name)
            .into_iter()
            .filter(|p| {
                with.iter()
                    .all(|(k, v)| p.attributes.get(*k).map(String::as_str) == Some(*v))
            })
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "{name} {with:?}: {:?}",
            self.points(name)
        );
        matching.into_iter().next().unwrap()
    }
}

pub fn attrs(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
